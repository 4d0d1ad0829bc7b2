"""Exposure budget: how many times one piece of training text may leave the client inside an export.

The noise of independent exports averages out as sqrt(K): an attacker who receives the same text K times
(local epochs, rounds over the same client data, a server resending one model) divides the noise by
sqrt(K) and reads a signal a single export hides. Each preset promises its strength up to a number of
exposures (``AegisConfig.exposures``); the tracker counts them and the shield enforces the budget.

**The counting rule** (``fingerprints``). The token ids of every forward under grad mode since the last
export are read by a forward pre-hook on the input embedding, with the attention mask from the model's own
forward when it has one. Every such forward counts (a pair or contrastive loss runs several before one
backward); the pending forwards are forgotten only when their gradients are gone (every flooded gradient
None, or, after a refusal, set to zero), never because another forward ran. Padding is dropped by the
attention mask (a row whose mask is all zero counts by its ids: its labels may still carry gradient),
else the pad id at either end; each row is split into segments at the model's special tokens (BOS, EOS,
SEP, CLS, pad), and each segment leaves fingerprints: its windows of ``WINDOW`` tokens, or, when it is
``WINDOW`` tokens or shorter, the segment itself and the segment less its first or its last token. A step
is over the budget when any of its fingerprints was already exported ``budget`` times; an export counts
once against each of its fingerprints. So one sentence counts as the same example when it comes back
without its EOS, padded otherwise, cut by one token (a short sentence) or by any number (a long one,
while one window survives), inside a sliding window or packed with others between separators. Text
that many examples share (a template, a signature) counts once per export that carries it: it is
exposed that often. Not caught: a short sentence cut by two or more tokens, or packed with no separator.
A forward that passed embeddings instead of ids (``inputs_embeds``), or a backward with no counted forward
at all (``model.forward`` called past the hooks), is refused unless ``track_examples`` gives the ids.

**Cost.** The ids are copied to the host during the forward and hashed on a worker thread while the
backward runs; ``decide()`` then costs one store transaction of the step's digests (``aegis.exposure_store``).

**Persistence** (``aegis.exposure_store``): the salt and the counts live in a store (an SQLite file and the
folder of sorted runs beside it) shared by every process that names it, and the budget decision is one
transaction of it. Under ``torch.distributed`` the ranks gather their rows, rank 0 decides for all of them,
and every rank follows.
"""
from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch
from torch import Tensor, nn

from . import ranks
from .exposure_store import (  # noqa: F401  (the public names of the store, re-exported)
    IN_MEMORY,
    WINDOW,
    ExposureStore,
    Worker,
    create_state,
    default_state_path,
    digest_key,
    reset_state,
)

Rows = list[frozenset[int]]  # one digest set per counted row (the store's 64-bit keys)


class ExposurePolicy(str, enum.Enum):
    """What ``mask_()`` does when a batch holds text already exported ``exposure_budget`` times.

    REFUSE:  raise (the default): the step stays refused (nothing can be exported or stepped) until its
             gradients are dropped (``zero_grad``) and a fresh batch runs forward and backward.
    SILENCE: flood that step with rho = 0 (pure noise: the export carries nothing about the batch and
             does not count), so federated rounds go on while the budget holds.
    OFF:     no tracking; the preset's guarantee holds for one exposure only (``report()`` says so).
    """

    REFUSE = "refuse"
    SILENCE = "silence"
    OFF = "off"


def fingerprints(row: np.ndarray, special: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
    """The token windows one row of ids is counted by (see the module docstring): a (k, WINDOW) int64 array
    of windows, each zero-padded after its length, and the (k,) lengths in tokens."""
    if special:
        is_special = np.isin(row, list(special))
        cuts = np.flatnonzero(is_special)
        segments = [s[~np.isin(s, list(special))] for s in np.split(row, cuts)] if len(cuts) else [row]
    else:
        segments = [row]
    windows, lengths = [], []
    for segment in segments:
        n = len(segment)
        if n > WINDOW:
            windows.append(np.lib.stride_tricks.sliding_window_view(segment, WINDOW))
            lengths.append(np.full(n - WINDOW + 1, WINDOW))
        elif n:
            short = [segment, segment[1:], segment[:-1]] if n > 1 else [segment]
            padded = np.zeros((len(short), WINDOW), np.int64)
            for i, part in enumerate(short):
                padded[i, : len(part)] = part
            windows.append(padded)
            lengths.append(np.array([len(part) for part in short]))
    if not windows:
        return np.zeros((0, WINDOW), np.int64), np.zeros(0, np.int64)
    return np.concatenate(windows).astype(np.int64), np.concatenate(lengths)


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The module that sees the token ids: model.get_input_embeddings(), else the first nn.Embedding."""
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    if embeddings is None:
        embeddings = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embeddings


def _special_ids(config: object) -> frozenset[int]:
    ids: set[int] = set()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id"):
        value = getattr(config, key, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int):
                ids.add(v)
    return frozenset(ids)


class _Counting:
    """The counting rule with the salt: rows of ids -> one digest set per row (runs on the worker). A
    window's digest is ``blake2b(its int64 tokens, little-endian; key=salt, digest_size=16)``: one short
    stretch of the interpreter lock per step (each window a slice of one bytes object, no call that
    releases and retakes the lock), so the backward's hooks wait little for it."""

    def __init__(self, salt: bytes, pad: int | None, special: frozenset[int]):
        self.keyed = hashlib.blake2b(key=salt, digest_size=16)
        self.pad, self.special = pad, special

    def rows(self, copy: _HostCopy) -> Rows:
        ids, mask = copy.wait()
        ids_np = ids.to(torch.int64).numpy()
        mask_np = None if mask is None else mask.numpy() != 0
        out = []
        for k, row in enumerate(ids_np):
            if mask_np is not None and mask_np[k].any():
                row = row[mask_np[k]]
            elif self.pad is not None:
                keep = np.flatnonzero(row != self.pad)
                row = row[keep[0] : keep[-1] + 1] if len(keep) else row[:0]
            out.append(frozenset(self.digests(*fingerprints(row, self.special))))
        return out

    def digests(self, windows: np.ndarray, lengths: np.ndarray) -> list[int]:
        """The store's keys (``digest_key``) of (k, WINDOW) zero-padded windows of the given lengths."""
        data = memoryview(windows.astype("<i8").tobytes())
        keys = []
        for i, n in enumerate(lengths.tolist()):
            h = self.keyed.copy()
            h.update(data[i * 8 * WINDOW : (i * WINDOW + n) * 8])
            keys.append(int.from_bytes(h.digest()[:8], "little", signed=True))
        return keys


_WORKER = Worker("aegis-exposure")  # hashes each forward's rows during the backward, then decides, in order


class _Pending:
    """One forward's rows, hashed on the worker once a backward starts (a forward no backward follows costs
    its copy only); recomputed here in a forked child (no worker there)."""

    def __init__(self, counting: _Counting, copy: _HostCopy):
        self.counting, self.copy, self.pid = counting, copy, os.getpid()
        self.future: Future[Rows] | None = None

    def start(self) -> None:
        if self.future is None and self.pid == os.getpid():
            self.future = _WORKER.submit(self.counting.rows, self.copy)

    def rows(self) -> Rows:
        if self.pid != os.getpid():
            return self.counting.rows(self.copy)
        self.start()
        assert self.future is not None
        return self.future.result()


class ExposureTracker:
    """Counts per fingerprint (salted token-window digest) how many masked exports carried it.

    ``gradients()`` returns the flooded gradients: the pending examples live in them, and are forgotten
    when those are dropped. A holder that exports something other than gradients (a round's delta) holds
    the pending examples across ``zero_grad`` with ``hold()``. With ``counting=False`` (ExposurePolicy.OFF)
    it only counts the rows of the step (``rows_pending``: the batch the preset's promise is stated for)."""

    def __init__(self, model: nn.Module, budget: int, gradients: Callable[[], list[Tensor | None]],
                 state: str | None, counting: bool = True):
        embeddings = input_embeddings(model)
        if embeddings is None:
            raise ValueError(
                "exposure tracking needs an nn.Embedding (or model.get_input_embeddings()) to see the token "
                "ids; pass AegisConfig(exposure=ExposurePolicy.OFF) and keep each batch to one export yourself"
            )
        config = getattr(model, "config", None)
        self.budget = budget
        self.store = ExposureStore(state) if counting else None
        self._counting = None if self.store is None else _Counting(
            self.store.salt, getattr(config, "pad_token_id", None), _special_ids(config))
        self._rows_pending = 0
        self._gradients = gradients
        self._pending: list[_Pending] = []  # digests of this step's forwards, hashed on the worker
        self._untracked = 0  # forwards of this step that passed no token ids (inputs_embeds)
        self._backward_seen = False  # a backward ran since the pending forwards began
        self._refused: list[tuple[Tensor, int]] | None = None  # the gradients of a refused step
        self._held = 0
        self._mask: Tensor | None = None  # the attention mask of the model forward in progress
        self._ids_seen = True
        self._paused = 0
        self.handles = [
            embeddings.register_forward_pre_hook(self._record),
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave),
        ]

    def __deepcopy__(self, memo: dict) -> ExposureTracker:
        # a deep copy of the protected model keeps counting into this client's tracker (over-counting is safe;
        # a second store or salt for the same client would not be)
        return self

    # -- what counts -----------------------------------------------------------------------
    def _active(self) -> bool:
        return not self._paused and torch.is_grad_enabled()

    def _forward_begins(self) -> None:
        """A counted forward starts: forget the pending examples if their gradients are gone."""
        if self._held or not self._backward_seen:
            return
        grads = self._gradients()
        if self._refused is not None:
            dropped = all(g is None or (not _same(g, seen) and not bool(g.any()))
                          for g, seen in zip(grads, self._refused))
        else:
            dropped = all(g is None for g in grads)
        if dropped:
            self.discard()

    def note_backward(self) -> None:
        if not self._backward_seen:
            for pending in self._pending:  # the step's forwards are in: hash them while the backward runs
                pending.start()
        self._backward_seen = True

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active():
            return
        mask = kwargs.get("attention_mask")
        self._mask = mask if isinstance(mask, Tensor) else None
        self._ids_seen = False

    def _leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._active() and not self._ids_seen:
            self._forward_begins()
            self._untracked += 1
        self._mask, self._ids_seen = None, True

    def _record(self, module: nn.Module, args: tuple) -> None:
        if not self._active() or not args or not isinstance(args[0], Tensor):
            return
        ids = args[0]
        if ids.dtype not in (torch.int64, torch.int32):
            return
        self._forward_begins()
        self._ids_seen = True
        mask = self._mask if self._mask is not None and self._mask.shape == ids.shape else None
        self._add(ids, mask)

    def _add(self, ids: Tensor, mask: Tensor | None) -> None:
        flat = ids.detach().reshape(-1, ids.shape[-1])
        self._rows_pending += flat.shape[0]
        if self._counting is not None:
            copy = _HostCopy(flat, None if mask is None else mask.detach().reshape(flat.shape))
            self._pending.append(_Pending(self._counting, copy))
            if self._backward_seen:  # accumulating: a backward of this step already ran
                self._pending[-1].start()

    def track(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> None:
        """The ids of a step whose forward received embeddings (``inputs_embeds``), given by the user."""
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}: pass the mask of these ids")
        self._forward_begins()
        self._add(input_ids, attention_mask)
        self._untracked = 0

    def paused(self) -> _Nested:
        """Forwards inside this context (the public calibration's) are not the client's examples."""
        return _Nested(self, "_paused")

    def hold(self) -> _Nested:
        """Inside this context the pending examples survive ``zero_grad`` (a round's local steps)."""
        return _Nested(self, "_held")

    # -- the decision ----------------------------------------------------------------------
    @property
    def counting(self) -> bool:
        return self.store is not None

    @property
    def rows_pending(self) -> int:
        """Sequences of the forwards since the last export (0 when none passed token ids)."""
        return self._rows_pending

    def _problem(self) -> str | None:
        if self._untracked:
            return ("a forward of this step received no token ids (inputs_embeds), so the exposure budget cannot "
                    "count its examples")
        if not self._rows_pending:
            return ("a gradient arrived but no forward of it was counted (model.forward() called directly, past the "
                    "module's hooks, or a forward under a paused tracker)")
        return None

    def decide(self) -> int:
        """The budget decision of the pending step, one store transaction: the number of rows holding text
        already exported ``budget`` times (nothing counted), or 0 with every fingerprint counted once more.
        Under torch.distributed every rank's rows are gathered and rank 0 decides for all."""
        problem = self._problem()
        rows = [] if problem else [row for pending in self._pending for row in pending.rows()]
        if ranks.distributed():
            problems, all_rows = ranks.gather(problem, rows)
            problem = next((p for p in problems if p), None)
            rows = all_rows
        if problem:
            raise RuntimeError(
                f"mask_() refused: {problem}. Call shield.track_examples(input_ids, attention_mask) with the batch's "
                "ids before mask_(), or pass AegisConfig(exposure=ExposurePolicy.OFF) and keep each example within "
                "the budget yourself")
        store = self.store
        if store is None:
            raise RuntimeError("decide(): this tracker counts rows only (ExposurePolicy.OFF)")
        if ranks.distributed():
            return ranks.decided_by_rank0(lambda: store.reserve(rows, self.budget))
        return store.reserve(rows, self.budget)

    def decide_async(self) -> Future[int]:
        """``decide()`` on the worker thread (after the step's hashing, in order), so the transaction runs while
        the caller launches the flood; the caller joins it before anything is stepped or exported. A problem
        is raised here at once; under torch.distributed (collectives) it decides here too."""
        problem = self._problem()
        store = self.store
        if problem or store is None or ranks.distributed():
            done: Future[int] = Future()
            done.set_result(self.decide())
            return done
        pending, budget = list(self._pending), self.budget
        for p in pending:  # queued before the decision on the one worker, so the decision never waits on itself
            p.start()
        return _WORKER.submit(lambda: store.reserve([row for p in pending for row in p.rows()], budget))

    def refuse(self, over: int, grads: list[Tensor | None]) -> RuntimeError:
        """The step was refused: it stays refused until these gradients are dropped (not merely changed).
        Returns the error to raise, naming the store and how much of it this process wrote."""
        self._refused = [(g, g._version) for g in grads if g is not None]
        store = self.store
        where = "memory (IN_MEMORY)" if store is None or store.path is None else str(store.path)
        mine = 0 if store is None else store.exports_here
        return RuntimeError(
            f"mask_() refused: {over} example(s) of this batch hold text already exported {self.budget} time(s), the "
            f"exposure budget of this configuration (noise averages out over repeated exports), counted in {where} "
            f"({mine} export(s) of it by this process). Drop these gradients (optimizer.zero_grad()) and skip the "
            "batch, raise lam by sqrt(K/budget) and set AegisConfig(exposure_budget=K), or "
            "AegisConfig(exposure=ExposurePolicy.SILENCE) to export pure noise for such steps")

    def discard(self) -> None:
        self._pending, self._untracked, self._backward_seen, self._refused = [], 0, False, None
        self._rows_pending = 0

    def wait_durable(self) -> None:
        if self.store is not None:
            self.store.wait_durable()

    @property
    def max_exposure(self) -> int:
        return 0 if self.store is None else self.store.max_count

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _same(grad: Tensor, seen: tuple[Tensor, int]) -> bool:
    return grad is seen[0] and grad._version == seen[1]


class _HostCopy:
    """Token ids (and their mask) on their way to the host. A CUDA tensor is copied asynchronously into
    pinned memory behind an event, which the worker waits on: neither the forward nor ``mask_()`` waits
    on the stream's later work (the backward)."""

    def __init__(self, ids: Tensor, mask: Tensor | None):
        self.tensors = [t for t in (ids, mask) if t is not None]
        self.has_mask = mask is not None
        self.ready: torch.cuda.Event | None = None
        if ids.is_cuda:
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self.tensors]
            for host, t in zip(hosts, self.tensors):
                host.copy_(t, non_blocking=True)
            self.tensors = hosts
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.tensors = [t.clone() for t in self.tensors]

    def wait(self) -> tuple[Tensor, Tensor | None]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors[0], self.tensors[1] if self.has_mask else None



class _Nested:
    """A context that raises one of the tracker's counters while it is open (re-entrant)."""

    def __init__(self, tracker: ExposureTracker, counter: str):
        self.tracker, self.counter = tracker, counter

    def __enter__(self) -> None:
        setattr(self.tracker, self.counter, getattr(self.tracker, self.counter) + 1)

    def __exit__(self, *exc) -> None:
        setattr(self.tracker, self.counter, getattr(self.tracker, self.counter) - 1)
