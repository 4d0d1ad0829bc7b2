"""The earlier single-module home of the Flower app, kept so existing app configs keep working
(``serverapp = "aegis.fl.app:server_app"``, ``clientapp = "aegis.fl.app:client_app"``).

New configs name :mod:`aegis.fl.server_app` and :mod:`aegis.fl.client_app` (``...:app``), as Flower's
own templates do; the in-process runners live in :mod:`aegis.fl.simulation` and :mod:`aegis.fl.rounds`.
"""

from .client_app import client_app
from .grid import InProcessGrid, flower_runtime
from .rounds import FederatedRun, SharedGradient, run_rounds
from .server_app import server_app
from .simulation import simulate
from .task import DEFAULT_RUN_CONFIG, tokenize, validation_loss

__all__ = [
    "DEFAULT_RUN_CONFIG",
    "FederatedRun",
    "InProcessGrid",
    "SharedGradient",
    "client_app",
    "flower_runtime",
    "run_rounds",
    "server_app",
    "simulate",
    "tokenize",
    "validation_loss",
]
