"""What a SuperNode decides for itself, never the server: its AEGIS floor, how many runs it keeps, how soon
it replies, and whether it is a simulated client.

Each setting comes from the node's own config (``flower-supernode --node-config 'aegis-preset="sentences"'``),
else from the node's environment, else its default; never from the run config or a message (both come
from the server):

======================  =====================  ================================================================
node config key         environment            meaning (default)
======================  =====================  ================================================================
``aegis-preset``        ``AEGIS_PRESET``       the preset this node runs at least ("verification"): the floor
                                               the run config may only tighten (:mod:`aegis.fl.floor`)
``aegis-max-runs``      ``AEGIS_MAX_RUNS``     runs whose models and batches the node keeps (4); the least
                                               recently used run's go first
``aegis-reply-floor``   ``AEGIS_REPLY_FLOOR``  seconds a reply waits at least (0.0), on top of the slowest
                                               reply of its kind so far (:class:`ReplyFloor`)
======================  =====================  ================================================================

A simulated client (:func:`simulated`: the in-process :func:`aegis.fl.simulation.simulate`, or Flower's
simulation runtime) counts its exposures per run (:func:`aegis.config.simulated_client`) and replies
without a floor: its timing reaches nobody.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

from flwr.app import Context, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from ..config import AegisConfig, simulated_client

PRESET_KEY, PRESET_ENV = "aegis-preset", "AEGIS_PRESET"
MAX_RUNS_KEY, MAX_RUNS_ENV, MAX_RUNS = "aegis-max-runs", "AEGIS_MAX_RUNS", 4
REPLY_FLOOR_KEY, REPLY_FLOOR_ENV = "aegis-reply-floor", "AEGIS_REPLY_FLOOR"
STORE_KEY, STORE_ENV = "aegis-exposure-state", "AEGIS_EXPOSURE_STATE"  # a deployed node's exposure store
# Loaded only where Flower's simulation runtime runs ClientApps: the Ray actors and the simulation process.
SIMULATION_MODULES = ("flwr.simulation.ray_transport.ray_actor", "flwr.server.superlink.fleet.vce.vce_api")

_IN_PROCESS: contextvars.ContextVar[bool] = contextvars.ContextVar("aegis_fl_in_process_simulation", default=False)
T = TypeVar("T")


@contextlib.contextmanager
def in_process_simulation() -> Iterator[None]:
    """Mark the ClientApp calls of this block as simulated (what :func:`aegis.fl.simulation.simulate` runs)."""
    token = _IN_PROCESS.set(True)
    try:
        yield
    finally:
        _IN_PROCESS.reset(token)


def simulated() -> bool:
    """True inside :func:`in_process_simulation` or in a process of Flower's simulation runtime."""
    return _IN_PROCESS.get() or any(m in sys.modules for m in SIMULATION_MODULES)


def setting(context: Context, key: str, env: str, default: Any) -> Any:
    """The node's own value of a setting: node config, else environment, else ``default``."""
    return context.node_config.get(key, os.environ.get(env, default))


def node_floor(context: Context) -> AegisConfig:
    """This node's own AEGIS configuration, the floor of every run: its pinned preset (default
    "verification") and, on the deployment engine, the exposure store it names (a default store would start
    over in every fresh container); a simulated client counts its exposures per run."""
    preset = setting(context, PRESET_KEY, PRESET_ENV, None)
    try:
        config = AegisConfig() if preset is None else AegisConfig(preset=str(preset))
    except ValueError as err:
        raise ValueError(f"node config '{PRESET_KEY}' / ${PRESET_ENV} = {preset!r}: {err}") from None
    if simulated():
        return simulated_client(config)
    store = setting(context, STORE_KEY, STORE_ENV, None)
    if not store:
        raise ValueError(f"a deployed node names its exposure store: node config '{STORE_KEY}' (or ${STORE_ENV}) = "
                         "the path of a store made once with aegis.exposure.create_state(PATH) and kept across "
                         "restarts; the default store would restart every count in a fresh container")
    return config.replace(exposure_state=str(store))


def max_runs(context: Context) -> int:
    value = setting(context, MAX_RUNS_KEY, MAX_RUNS_ENV, MAX_RUNS)
    try:
        runs = int(value)
    except (TypeError, ValueError):
        runs = 0
    if isinstance(value, bool) or runs < 1 or str(runs) != str(value).strip():
        raise ValueError(f"node config '{MAX_RUNS_KEY}' / ${MAX_RUNS_ENV} = {value!r}: use an integer >= 1")
    return runs


def reply_floor(context: Context) -> float:
    value = setting(context, REPLY_FLOOR_KEY, REPLY_FLOOR_ENV, 0.0)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not 0.0 <= seconds < float("inf"):
        raise ValueError(f"node config '{REPLY_FLOOR_KEY}' / ${REPLY_FLOOR_ENV} = {value!r}: use seconds >= 0")
    return seconds


class RunCache(Generic[T]):
    """A node's per-run state (models, batches, shields) for its ``max_runs`` most recently used runs only:
    a server that opens runs cannot grow the node's memory. ``len()`` counts the entries kept."""

    def __init__(self) -> None:
        self._runs: OrderedDict[int, dict[Hashable, T]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run_id: int, key: Hashable, build: Callable[[], T], max_runs: int) -> T:
        """The entry ``key`` of run ``run_id``, built on first use; older runs beyond ``max_runs`` are dropped
        first (so at most ``max_runs`` runs' state is alive while the new one is built)."""
        with self._lock:
            entries = self._runs.pop(run_id, {})
            while len(self._runs) >= max_runs:
                self._runs.popitem(last=False)
            self._runs[run_id] = entries
            if key not in entries:
                entries[key] = build()
            return entries[key]

    def runs(self) -> list[int]:
        """The runs kept, least recently used first."""
        return list(self._runs)

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._runs.values())


def reply_kind(msg: Message) -> tuple[str, str]:
    """What a reply's time is compared with: the message type and, for SecAgg+, its stage (both public)."""
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    stage = configs.get(Key.STAGE) if configs is not None else None
    return msg.metadata.message_type, str(stage or "")


class ReplyFloor:
    """Flower client mod: no reply leaves earlier than ``seconds`` after its message reached the mod, nor
    earlier than the slowest reply of its kind (:func:`reply_kind`) before it. A refusal, which stops at an
    early stage, then takes as long as the replies that went further, and the time of a reply does not
    grow with what the node exported before unless it outgrows every earlier reply of its kind.

    ``seconds``: a number, or ``context -> seconds`` (the node's own setting). Put it first in ``mods``
    (the outermost), so that it times everything below it."""

    def __init__(self, seconds: float | Callable[[Context], float] = 0.0, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.seconds, self.clock, self.sleep = seconds, clock, sleep
        self.slowest: dict[tuple[str, str], float] = {}

    def __call__(self, msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        start, kind = self.clock(), reply_kind(msg)
        floor = self.seconds(context) if callable(self.seconds) else self.seconds
        try:
            return call_next(msg, context)
        finally:
            elapsed = self.clock() - start
            wait = max(floor, self.slowest.get(kind, 0.0)) - elapsed
            self.slowest[kind] = max(self.slowest.get(kind, 0.0), elapsed)
            if wait > 0:
                self.sleep(wait)
