"""Tiny random-config models of every family the policy must cover (no downloads)."""
from __future__ import annotations

import torch
import transformers as T

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _decoder(config_cls, model_cls, **kw):
    return lambda: model_cls(config_cls(**_COMMON, **kw))


_LAYERS = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)

FAMILIES = {
    "gpt2": _decoder(T.GPT2Config, T.GPT2LMHeadModel, n_layer=1, n_embd=32, n_head=2, n_positions=64),
    "gpt2-untied": _decoder(
        T.GPT2Config, T.GPT2LMHeadModel, n_layer=1, n_embd=32, n_head=2, n_positions=64, tie_word_embeddings=False
    ),
    "gpt-neox": _decoder(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, **_LAYERS),
    "opt": _decoder(T.OPTConfig, T.OPTForCausalLM, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                    ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64),
    "llama": _decoder(T.LlamaConfig, T.LlamaForCausalLM, **_LAYERS),
    "qwen2": _decoder(T.Qwen2Config, T.Qwen2ForCausalLM, num_key_value_heads=1, **_LAYERS),
    "mistral": _decoder(T.MistralConfig, T.MistralForCausalLM, num_key_value_heads=1, **_LAYERS),
    "gemma": _decoder(T.GemmaConfig, T.GemmaForCausalLM, num_key_value_heads=1, head_dim=16, **_LAYERS),
    "phi": _decoder(T.PhiConfig, T.PhiForCausalLM, **_LAYERS),
    "bert-cls": _decoder(T.BertConfig, T.BertForSequenceClassification, max_position_embeddings=64, **_LAYERS),
    # BERT run causally with its MLM head (the default decoder's family): a vocabulary bias of V entries
    "bert-causal": _decoder(T.BertConfig, T.BertLMHeadModel, is_decoder=True, max_position_embeddings=64, **_LAYERS),
    "roberta-cls": _decoder(T.RobertaConfig, T.RobertaForSequenceClassification, max_position_embeddings=64, **_LAYERS),
    "gpt2-cls": _decoder(T.GPT2Config, T.GPT2ForSequenceClassification, n_layer=1, n_embd=32, n_head=2, n_positions=64),
    "llama-cls": _decoder(T.LlamaConfig, T.LlamaForSequenceClassification, **_LAYERS),
}


_ENCODER = dict(max_position_embeddings=64, **_LAYERS)
_DISTIL = dict(
    vocab_size=VOCAB, pad_token_id=0, n_layers=1, dim=32, n_heads=2, hidden_dim=64, max_position_embeddings=64
)
_T5 = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, d_model=32, d_kv=16, d_ff=64,
           num_layers=1, num_heads=2)

# Further families (and heads) whose every parameter the policy must classify (tests/test_policy_roles.py).
# Kept out of FAMILIES, whose shield tests (loss, export) have not been run on them.
MORE_FAMILIES = {
    "albert-mlm": _decoder(T.AlbertConfig, T.AlbertForMaskedLM, embedding_size=16, **_ENCODER),
    "albert-cls": _decoder(T.AlbertConfig, T.AlbertForSequenceClassification, embedding_size=16, **_ENCODER),
    "albert-pretraining": _decoder(T.AlbertConfig, T.AlbertForPreTraining, embedding_size=16, **_ENCODER),
    "electra-discriminator": _decoder(T.ElectraConfig, T.ElectraForPreTraining, embedding_size=16, **_ENCODER),
    "electra-generator": _decoder(T.ElectraConfig, T.ElectraForMaskedLM, embedding_size=16, **_ENCODER),
    "electra-cls": _decoder(T.ElectraConfig, T.ElectraForSequenceClassification, embedding_size=16, **_ENCODER),
    "distilbert-cls": lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(**_DISTIL)),
    "distilbert-mlm": lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(**_DISTIL)),
    "bert-mlm": _decoder(T.BertConfig, T.BertForMaskedLM, **_ENCODER),
    "roberta-mlm": _decoder(T.RobertaConfig, T.RobertaForMaskedLM, **_ENCODER),
    "opt-projected": _decoder(T.OPTConfig, T.OPTForCausalLM, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                              ffn_dim=64, word_embed_proj_dim=16, max_position_embeddings=64),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(**_T5)),
    "t5-gated": lambda: T.T5ForConditionalGeneration(T.T5Config(**_T5, feed_forward_proj="gated-gelu")),
}
POLICY_FAMILIES = {**FAMILIES, **MORE_FAMILIES}


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return POLICY_FAMILIES[family]().eval()


def loss_of(model, seed: int = 0, batch: int = 2, length: int = 9):
    """A causal-LM or classification loss on random tokens (ids >= 3 avoid pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    if "ForSequenceClassification" in type(model).__name__:
        labels = torch.randint(0, model.config.num_labels, (batch,), generator=g)
        return model(input_ids=ids, labels=labels).loss
    return model(input_ids=ids, labels=ids).loss
