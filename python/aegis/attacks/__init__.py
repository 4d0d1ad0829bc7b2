"""Gradient inversion attacks AEGIS is measured against (DESIGN §6); their names: :mod:`.registry`.

Every text attack has the signature ``attack(model, grads, tokenizer, batch_size) -> list[str]``: the server's
copy of the model, the gradient dict one client shared (``shared_gradient``), and the batch size. A missing
or all-zero tensor means that channel is closed: an attack returns what it can, possibly ``[]``.

The functions below load on first use, so that naming the attacks (``aegis --help``) costs no torch import.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .registry import ATTACKS, NAMES, TEXT, Attack, Family, attack, text_attack, text_attacks

if TYPE_CHECKING:
    from .dager import dager
    from .embedding_norm import embedding_norm
    from .embedding_projection import embedding_projection
    from .fingerprint import fingerprint_accuracy, identify_sentence, secret_completion, verify
    from .gradients import shared_gradient
    from .labels import infer_labels, label_accuracy, label_null
    from .mlp_span import mlp_span
    from .spectral import spectral
    from .tag import tag

_HOME = {  # public function -> the submodule defining it
    "shared_gradient": "gradients",
    "dager": "dager",
    "mlp_span": "mlp_span",
    "spectral": "spectral",
    "embedding_norm": "embedding_norm",
    "embedding_projection": "embedding_projection",
    "tag": "tag",
    "infer_labels": "labels",
    "label_accuracy": "labels",
    "label_null": "labels",
    "verify": "fingerprint",
    "secret_completion": "fingerprint",
    "identify_sentence": "fingerprint",
    "fingerprint_accuracy": "fingerprint",
}

__all__ = [
    "shared_gradient",
    "dager",
    "mlp_span",
    "spectral",
    "embedding_norm",
    "embedding_projection",
    "tag",
    "infer_labels",
    "label_accuracy",
    "label_null",
    "verify",
    "secret_completion",
    "identify_sentence",
    "fingerprint_accuracy",
    "ATTACKS",
    "NAMES",
    "TEXT",
    "Attack",
    "Family",
    "attack",
    "text_attack",
    "text_attacks",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Loading submodule ``dager`` binds it as this package's attribute ``dager``, which would hide the
    function of that name: a function keeps its name here, the submodule stays in ``sys.modules``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _HOME.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
