"""Secure rounds: AEGIS over Flower's SecAgg+, where the server sees only the sum of a round's updates and
each client adds a ``1 / sqrt(t)`` share of the flood, ``t`` the smallest survivor count it accepts.

* :mod:`~aegis.fl.secure.guard` — :class:`SurvivorPin`; :class:`SecureGuard`, the outermost client mod
  (refuses setups below the pin, unknown peers, shrunken survivor sets, coarse quantisation, clear text);
  :func:`check_quantisation`.
* :mod:`~aegis.fl.secure.client` — :class:`SecureTrainer`, the train function inside ``secaggplus_mod``;
  :func:`noise_share`.
* :mod:`~aegis.fl.secure.server` — :class:`SecAggPlus` (Flower's workflow, dropouts before key sharing
  leave the round), :class:`SecureStrategy`, :func:`required_clipping_range`.
* :mod:`~aegis.fl.secure.patch` — SecAgg+ masks from ChaCha20 keyed by the whole seed, patched into Flower.
* :mod:`~aegis.fl.secure.rounds` — :func:`run_secure_rounds` in process; :class:`SecureRun` with its (epsilon,
  delta) (:mod:`~aegis.fl.secure.accountant`).
* :mod:`~aegis.fl.secure.app` — the secure side of the Flower apps; :mod:`~aegis.fl.secure.record` — what each
  side saw, for tests.
* :mod:`~aegis.fl.secure.shortcut` — a round's sum without the round; :mod:`~aegis.fl.secure.audit` — what a
  server running SecAgg+ attacks.
* :mod:`~aegis.fl.secure.delta_rounds` — delta mode under SecAgg+: :func:`run_secure_delta_rounds`, the
  share, user-level (epsilon, delta), the delta shortcut and the ``VERIFICATION_AT_SCALE`` recipe;
  :mod:`~aegis.fl.secure.cohort` — many LoRA clients trained at once.
"""

from .client import SecureTrainer, noise_share
from .guard import REFUSAL, SecureGuard, SurvivorPin, check_quantisation
from .rounds import SecureRun, run_secure_rounds
from .server import SecAggPlus, SecureStrategy, required_clipping_range

__all__ = [
    "REFUSAL",
    "SecAggPlus",
    "SecureGuard",
    "SecureRun",
    "SecureStrategy",
    "SecureTrainer",
    "SurvivorPin",
    "check_quantisation",
    "noise_share",
    "required_clipping_range",
    "run_secure_rounds",
]
