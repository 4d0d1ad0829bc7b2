"""Hugging Face Trainer integration (imports transformers only when used)."""
from __future__ import annotations

from transformers import TrainerCallback


class AegisCallback(TrainerCallback):
    """Masks the gradients after clipping and before ``optimizer.step()`` in ``transformers.Trainer``."""

    def __init__(self, shield):
        self.shield = shield

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.shield.ensure_masked()
        return control
