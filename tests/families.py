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
    "roberta-cls": _decoder(T.RobertaConfig, T.RobertaForSequenceClassification, max_position_embeddings=64, **_LAYERS),
    "gpt2-cls": _decoder(T.GPT2Config, T.GPT2ForSequenceClassification, n_layer=1, n_embd=32, n_head=2, n_positions=64),
    "llama-cls": _decoder(T.LlamaConfig, T.LlamaForSequenceClassification, **_LAYERS),
}


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return FAMILIES[family]().eval()


def loss_of(model, seed: int = 0, batch: int = 2, length: int = 9):
    """A causal-LM or classification loss on random tokens (ids >= 3 avoid pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    if "ForSequenceClassification" in type(model).__name__:
        labels = torch.randint(0, model.config.num_labels, (batch,), generator=g)
        return model(input_ids=ids, labels=labels).loss
    return model(input_ids=ids, labels=ids).loss
