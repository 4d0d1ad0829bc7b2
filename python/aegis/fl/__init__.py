"""AEGIS on Flower (DESIGN §5): FedSGD gradient sharing with a client mod that fails closed.

* :class:`ClientTrainer` — the ClientApp train function: batch gradient, defence, fp32 reply.
* :class:`AegisMod` — configures AEGIS from ``context.run_config``; refuses replies that were not masked.
* :class:`FedSGD` — server strategy: weighted mean of client gradients, server optimizer step,
  failed / missing / malformed replies tolerated and counted.
* ``aegis.fl.app`` — ``server_app`` / ``client_app`` for ``flwr run``, :func:`simulate` (the same apps
  in process) and :func:`run_rounds` (the audit's runner: every shared gradient captured at the server).

Imports only ``flwr.app``, ``flwr.clientapp`` and ``flwr.serverapp`` (plus one isolated internal
setter in :func:`aegis.fl.app.flower_runtime`); ``import aegis`` itself never imports Flower.
"""
try:
    import flwr  # noqa: F401
except ImportError as err:
    raise ImportError("aegis.fl needs Flower: pip install 'flwr>=1.42'") from err

from .app import FederatedRun, InProcessGrid, SharedGradient, flower_runtime, run_rounds, simulate
from .client import (
    AegisMod,
    ClientTrainer,
    active_config,
    config_from_run_config,
    digest,
    load_arrays,
    pack_gradients,
    pack_masked,
    trainable_arrays,
)
from .strategy import FedSGD

__all__ = [
    "AegisMod",
    "ClientTrainer",
    "FedSGD",
    "FederatedRun",
    "InProcessGrid",
    "SharedGradient",
    "active_config",
    "config_from_run_config",
    "digest",
    "flower_runtime",
    "load_arrays",
    "pack_gradients",
    "pack_masked",
    "run_rounds",
    "simulate",
    "trainable_arrays",
]
