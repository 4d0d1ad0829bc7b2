"""AEGIS: Attention-Embedding Gradient Isolation Shield for federated fine-tuning of language models."""
from .config import PRESETS, ROLES, AegisConfig, Treatment
from .shield import CoverageReport, Shield, protect

__all__ = ["AegisConfig", "Treatment", "PRESETS", "ROLES", "Shield", "CoverageReport", "protect"]
__version__ = "0.1.0"
