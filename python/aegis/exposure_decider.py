"""The decider: a process of its own that hashes each step's token ids and takes the budget decision.

Why a process: the hashing (hundreds of keyed blake2b calls a step) and the store's transaction are Python
work. On a worker thread they hold the interpreter lock while the training thread launches the backward's
kernels; in a launch-bound step (a small model, a small batch) every millisecond of it is a millisecond of
the step. Here the training process only copies the ids to the host and writes them down a socket; the
decider (``python -m aegis.exposure_decider``, torch-free) hashes them as they arrive and takes the decision,
both during the backward.

One decider per training process, started by the first counting shield and ended when its socket closes
(the training process exits, or forks and lets go of it). Each tracker opens a *counter* on it: the store
(a path the training process has already checked, or ``IN_MEMORY``, whose counts then live in the decider)
and the model's pad and special ids. Messages, in order on one socket, sent from one worker thread:

- ``("open", key, state, store_id, pad, special)``, answered: the decider opens the store and checks its id;
- ``("rows", key, token, ids, mask)``: one forward's ids (numpy), hashed at once and kept under ``token``;
- ``("decide", key, tokens, arrays, budget, step)``, answered ``(over, exports_here)``: the rows of ``tokens``
  and of ``arrays`` (ids sent with the decision: another rank's, or rows a restarted decider never saw),
  then ``ExposureStore.reserve``; rows it counted are forgotten, a refused step's are kept for its retry.
  A step decided in parts (gradient accumulation: a decision at each backward) counts its text once:
  digests an earlier decision of the same ``step`` counted are stripped from the later ones (``step`` None:
  a decision of its own);
- ``("durable", key)`` and ``("max_count", key)``, answered; ``("drop", key, tokens)`` and ``("close", key)``.

An error in the decider is sent back with its type and raised in the training process. If the decider
exits, the step being decided fails (nothing is exported; its reservation may have been made: over-counting
is safe) and the next call starts a new one: a store is opened again, but counts kept ``IN_MEMORY`` are gone,
so such a counter refuses from then on, as it does in a forked child.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .exposure_counting import Counting, Rows
from .exposure_db import Worker
from .exposure_store import IN_MEMORY, ExposureStore

T = TypeVar("T")
Arrays = tuple[np.ndarray, "np.ndarray | None"]  # one forward's (ids, mask) on the host
_ERRORS: dict[str, type[Exception]] = {e.__name__: e for e in (
    ValueError, RuntimeError, OSError, FileNotFoundError, FileExistsError, PermissionError)}


# -- the training process's end ----------------------------------------------------------------
class _Decider:
    """This process's decider and its socket; used from the one worker thread only."""

    def __init__(self) -> None:
        self.generation = 0  # one more for every decider started: counters opened on an older one re-open
        self._conn: Connection | None = None
        self._proc: subprocess.Popen | None = None
        os.register_at_fork(after_in_child=self._let_go)

    def _let_go(self) -> None:
        """A forked child starts its own decider; the parent's keeps running for the parent."""
        if self._conn is not None:
            self._conn.close()
        self._conn, self._proc = None, None

    def _connection(self) -> Connection:
        if self._conn is None:
            ours, theirs = socket.socketpair()
            package_root = str(Path(__file__).resolve().parents[1])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root,
                                                                             os.environ.get("PYTHONPATH")])))
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "aegis.exposure_decider", str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                    start_new_session=True)  # a Ctrl-C for the training process must not kill it first
            except (OSError, ValueError) as err:  # ValueError: no pass_fds (not a POSIX system)
                ours.close()
                raise RuntimeError(f"the exposure decider process could not start ({err}): sys.executable="
                                   f"{sys.executable!r} must run this Python; nothing was exported") from None
            finally:
                theirs.close()
            self._conn = Connection(ours.detach())
            self.generation += 1
        return self._conn

    def ensure(self) -> int:
        """Start the decider unless it runs; its generation."""
        self._connection()
        return self.generation

    def send(self, message: tuple) -> None:
        try:
            conn = self._connection()
            while _CLOSED:
                conn.send(("close", _CLOSED.popleft()))
            conn.send(message)
        except OSError:
            raise self._lost() from None

    def call(self, message: tuple) -> Any:
        self.send(message)
        try:
            kind, *answer = self._connection().recv()
        except (EOFError, OSError):
            raise self._lost() from None
        if kind == "error":
            name, text = answer
            raise _ERRORS.get(name, RuntimeError)(text)
        return answer[0]

    def _lost(self) -> RuntimeError:
        proc = self._proc
        self._let_go()  # a decider still running reads the end of its socket and exits
        try:
            code = None if proc is None else proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"the exposure decider process exited (code {code}): this step was not exported and "
                            "may have been counted; the next step starts a new decider")


_DECIDER = _Decider()
_WORKER = Worker("aegis-exposure")  # every message to the decider, in order
_KEYS = itertools.count(1)
_CLOSED: collections.deque[int] = collections.deque()  # counters whose trackers are gone, closed at the next send


def closed(key: int) -> None:
    """Close counter ``key`` in the decider before the next message. Takes no lock, so a garbage collector's
    finalizer may call it anywhere (inside another executor's ``submit``, which holds the executors' shared
    lock, a ``submit`` here would deadlock)."""
    _CLOSED.append(key)


class Pending:
    """One forward's ids on their way to the decider: ``arrays()`` gives them on the host (waiting for their
    copy); ``token`` and ``sent_on`` (the decider generation) once sent; ``held`` while the decider may hold
    its rows (from the moment it is queued for sending until a decision counts them)."""

    def __init__(self, arrays: Callable[[], Arrays]):
        self.arrays = arrays
        self.token: int | None = None
        self.sent_on: int | None = None
        self.held = False


def on_worker(fn: Callable[..., T], *args: object) -> Future[T]:
    return _WORKER.submit(fn, *args)


class Counter:
    """One tracker's counter in the decider: a store and the model's counting rule. Every method runs on
    the worker thread (``on_worker``)."""

    def __init__(self, store: ExposureStore, pad: int | None, special: frozenset[int]):
        self.state = IN_MEMORY if store.path is None else str(store.path)
        self.store_id = store.store_id
        self.pad, self.special = pad, special
        self.key = next(_KEYS)
        self._opened_on: int | None = None  # the decider generation it is open on
        self._decided_on: int | None = None  # ... and that took its last decision
        self._tokens = itertools.count(1)

    def open(self) -> int:
        """Open (or re-open, on a new decider) this counter; the decider's generation."""
        generation = _DECIDER.ensure()
        if self._opened_on != generation:
            if self._opened_on is not None and self.state == IN_MEMORY:
                raise RuntimeError(
                    "the exposure counts kept in memory (exposure_state=IN_MEMORY) were lost with the decider "
                    "process, or do not follow os.fork(): nothing was exported; name a store "
                    "(AegisConfig(exposure_state=PATH)) whose counts outlive the process")
            _DECIDER.call(("open", self.key, self.state, self.store_id, self.pad, self.special))
            self._opened_on = generation
        return generation

    def send(self, pending: Pending) -> None:
        """Send one forward's ids, to be hashed at once."""
        generation = self.open()
        pending.token, pending.sent_on = next(self._tokens), generation
        _DECIDER.send(("rows", self.key, pending.token, *pending.arrays()))

    def decide(self, pending: Sequence[Pending], extra: Sequence[Arrays], budget: int,
               step: int | None = None) -> tuple[int, int]:
        """(over, exports_here) of the ``pending`` forwards and the ``extra`` rows: those the decider holds by
        token, the others (never sent, or sent to a decider that has exited since) with the decision.
        Decisions of one ``step`` count its text once."""
        generation = self.open()
        tokens = [p.token for p in pending if p.sent_on == generation]
        arrays = [p.arrays() for p in pending if p.sent_on != generation] + list(extra)
        over, here = _DECIDER.call(("decide", self.key, tokens, arrays, budget, step))
        self._decided_on = generation
        if not over:  # counted: the decider let go of their rows (a refused step keeps them for its retry)
            for p in pending:
                p.sent_on, p.held = None, False
        return over, here

    def drop(self, pending: Sequence[Pending]) -> None:
        tokens = [p.token for p in pending if p.sent_on == _DECIDER.generation]
        if tokens and self._opened_on == _DECIDER.generation:
            _DECIDER.send(("drop", self.key, tokens))

    def durable(self) -> None:
        """Wait until the last decision's count survives a power loss (``export()`` calls this)."""
        if self._decided_on is None:
            return
        if self._decided_on != _DECIDER.generation:
            raise RuntimeError("the exposure decider that counted this step exited before its count was durable: "
                               "nothing was exported; run the step again")
        _DECIDER.call(("durable", self.key))

    def max_count(self) -> int:
        self.open()
        return int(_DECIDER.call(("max_count", self.key)))


# -- the decider's end -------------------------------------------------------------------------
class _Open:
    """A counter as the decider holds it: the store, the counting rule and the hashed rows by token (until a
    decision counts them, or the training process drops them: a refused step keeps its rows)."""

    def __init__(self, state: str, store_id: str, pad: int | None, special: frozenset[int]):
        self.store = ExposureStore(state)
        if state != IN_MEMORY and self.store.store_id != store_id:
            raise RuntimeError(f"exposure state {state} was replaced (its store id changed) between the shield and "
                               "its decider: restore the original file; nothing was exported")
        self.counting = Counting(self.store.salt, pad, special)
        self.rows: dict[int, Rows | BaseException] = {}
        self.step: int | None = None  # the step whose earlier decisions counted ``counted``
        self.counted: set[int] = set()

    def hashed(self, token: int) -> Rows:
        rows = self.rows.get(token)  # kept until counted or dropped: a refused step is decided again
        if rows is None:
            raise RuntimeError(f"the ids of token {token} never reached the exposure decider; nothing was exported")
        if isinstance(rows, BaseException):
            raise rows
        return rows


def _handle(counters: dict[int, _Open], kind: str, key: int, args: list) -> Any:
    if kind == "open":
        counters[key] = _Open(*args)
        return None
    counter = counters.get(key)
    if counter is None:
        if kind in ("drop", "close"):
            return None
        raise RuntimeError(f"exposure counter {key} is not open in the decider; nothing was exported")
    if kind == "rows":
        token, ids, mask = args
        try:
            counter.rows[token] = counter.counting.rows(ids, mask)
        except Exception as err:  # raised at the decision that names these rows
            counter.rows[token] = err
        return None
    if kind == "decide":
        tokens, arrays, budget, step = args
        rows = [row for token in tokens for row in counter.hashed(token)]
        rows += [row for ids, mask in arrays for row in counter.counting.rows(ids, mask)]
        if step is None or step != counter.step:
            counter.step, counter.counted = step, set()
        elif counter.counted:  # this step counted these digests already: once per export
            rows = [row - counter.counted for row in rows]
        over = counter.store.reserve(rows, budget)
        if not over:  # counted once: never decided again
            for token in tokens:
                del counter.rows[token]
            if step is not None:
                counter.counted.update(*rows)
        return over, counter.store.exports_here
    if kind == "drop":
        for token in args[0]:
            counter.rows.pop(token, None)
        return None
    if kind == "durable":
        counter.store.wait_durable()
        return None
    if kind == "max_count":
        return counter.store.max_count
    if kind == "close":
        del counters[key]
        return None
    raise ValueError(f"unknown message {kind!r} to the exposure decider")


_ANSWERED = frozenset({"open", "decide", "durable", "max_count"})


def serve(conn: Connection) -> None:
    """Answer the training process until it closes the socket."""
    counters: dict[int, _Open] = {}
    while True:
        try:
            kind, key, *args = conn.recv()
        except EOFError:
            return
        answer: tuple
        try:
            answer = ("ok", _handle(counters, kind, key, args))
        except Exception as err:
            answer = ("error", type(err).__name__, str(err))
        if kind in _ANSWERED:
            conn.send(answer)


def _main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process ends it by closing the socket
    logging.basicConfig(format="aegis exposure decider: %(levelname)s %(message)s")
    serve(Connection(int(argv[1])))


if __name__ == "__main__":
    _main(sys.argv)
