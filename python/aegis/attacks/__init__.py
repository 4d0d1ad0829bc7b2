"""Gradient inversion attacks AEGIS is measured against (DESIGN §6).

Every attack has the signature ``attack(model, grads, tokenizer, batch_size) -> list[str]``: the server's
copy of the model, the gradient dict one client shared (``shared_gradient``), and the batch size. A missing
or all-zero tensor means that channel is closed: an attack returns what it can, possibly ``[]``.
"""
from .dager import dager
from .embedding_norm import embedding_norm
from .fingerprint import fingerprint_accuracy, identify_sentence, secret_completion, verify
from .gradients import shared_gradient
from .labels import infer_labels, label_accuracy, label_null
from .mlp_span import mlp_span
from .spectral import spectral
from .tag import tag

__all__ = [
    "shared_gradient",
    "dager",
    "mlp_span",
    "spectral",
    "embedding_norm",
    "tag",
    "infer_labels",
    "label_accuracy",
    "label_null",
    "verify",
    "secret_completion",
    "identify_sentence",
    "fingerprint_accuracy",
]
