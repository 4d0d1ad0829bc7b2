"""AEGIS on Flower (docs: ``python/aegis/fl/README.md``): FedSGD gradient sharing with a client mod that
fails closed. Laid out as a Flower app:

* :mod:`~aegis.fl.client` — :class:`ClientTrainer` (the train function: batch gradient, defence, fp32
  reply) and :class:`AegisMod` (runs the client's own configuration, which the run config may only tighten:
  :mod:`~aegis.fl.floor`; refuses unmasked replies).
* :mod:`~aegis.fl.node` — what a SuperNode decides for itself: its preset, runs kept, reply floor.
* :mod:`~aegis.fl.client_app` / :mod:`~aegis.fl.server_app` — ``app`` for ``flwr run``.
* :mod:`~aegis.fl.strategy` — :class:`FedSGD`: weighted mean of client gradients, server optimizer step,
  failed / missing / malformed replies tolerated and counted.
* :mod:`~aegis.fl.task` — the app's model, data and validation loss.
* :mod:`~aegis.fl.grid` — :class:`InProcessGrid`; :func:`flower_runtime`, the one setter of a Flower internal.
* :mod:`~aegis.fl.simulation` — :func:`simulate` (the same apps in process, no Ray).
* :mod:`~aegis.fl.rounds` — :func:`run_rounds`, the audit's runner: every shared gradient captured.
* :mod:`~aegis.fl.secure` — secure rounds over SecAgg+.

Imports only ``flwr.app``, ``flwr.clientapp`` and ``flwr.serverapp`` (plus the isolated internal setter
in :func:`flower_runtime`); ``import aegis`` itself never imports Flower, and ``aegis.fl`` never imports
the comparators (:mod:`aegis.baselines`) unless a run names one.
"""

try:
    import flwr  # noqa: F401
except ImportError as err:
    raise ImportError("aegis.fl needs Flower: pip install 'aegis-flood[fl]'") from err

from .client import (
    AegisMod,
    ClientTrainer,
    active_config,
    digest,
    load_arrays,
    pack_gradients,
    pack_masked,
    trainable_arrays,
)
from .floor import config_from_run_config
from .grid import InProcessGrid, flower_runtime
from .rounds import FederatedRun, SharedGradient, run_rounds
from .simulation import simulate
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
