"""Utility you can trust: long federated runs without Flower, learning curves per defence, and the
privacy-utility frontier (``benchmarks/utility.py``, ``aegis utility``).

Imports torch, numpy and transformers only; the text attacks' ROUGE scoring (rouge-score) and DP-SGD
(Opacus) are imported where used.
"""

from .config import DEFENCES, MODELS, Algorithm, Optimizer, UtilityConfig
from .harness import run_utility

__all__ = ["DEFENCES", "MODELS", "Algorithm", "Optimizer", "UtilityConfig", "run_utility"]
