"""AEGIS: Attention-Embedding Gradient Isolation Shield for federated fine-tuning of language models.

The public names load on first use, so that ``aegis --help`` and other torch-free paths stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import calibration, exposure
    from .config import (
        PRESETS,
        ROLES,
        AegisConfig,
        Calibration,
        ExportMode,
        NonFinite,
        Preset,
        Promise,
        Threat,
        Treatment,
    )
    from .delta import DeltaShield
    from .exposure import ExposurePolicy
    from .shield import CoverageReport, Shield, protect

_HOME = {  # public name -> the submodule defining it
    **dict.fromkeys(("PRESETS", "ROLES", "AegisConfig", "Calibration", "ExportMode", "NonFinite", "Preset", "Promise",
                     "Threat", "Treatment"), "config"),
    "DeltaShield": "delta",
    "ExposurePolicy": "exposure",
    **dict.fromkeys(("CoverageReport", "Shield", "protect"), "shield"),
}
__all__ = [
    "AegisConfig",
    "Calibration",
    "ExportMode",
    "NonFinite",
    "Treatment",
    "Preset",
    "Promise",
    "Threat",
    "ExposurePolicy",
    "PRESETS",
    "ROLES",
    "Shield",
    "DeltaShield",
    "CoverageReport",
    "protect",
    "calibration",
    "exposure",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    else:  # a submodule (``aegis.exposure``) reached as an attribute
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value
