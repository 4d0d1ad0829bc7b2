"""AEGIS: Attention-Embedding Gradient Isolation Shield for federated fine-tuning of language models."""
from . import calibration, exposure
from .config import PRESETS, ROLES, AegisConfig, Calibration, Preset, Promise, Threat, Treatment
from .exposure import ExposurePolicy
from .shield import CoverageReport, Shield, protect

__all__ = [
    "AegisConfig",
    "Calibration",
    "Treatment",
    "Preset",
    "Promise",
    "Threat",
    "ExposurePolicy",
    "PRESETS",
    "ROLES",
    "Shield",
    "CoverageReport",
    "protect",
    "calibration",
    "exposure",
]
__version__ = "0.1.0"
