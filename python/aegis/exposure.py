"""Exposure budget: how many times one piece of training text may leave the client inside an export.

The noise of independent exports averages out as sqrt(K): an attacker who receives the same text K times
(local epochs, rounds over the same client data, a server resending one model) divides the noise by
sqrt(K) and reads a signal a single export hides. Each preset promises its strength up to a number of
exposures (``AegisConfig.exposures``); the tracker counts them and the shield enforces the budget.

**The counting rule** (``fingerprints``). The token ids of every forward under grad mode since the
gradients were last empty or masked are read by a forward pre-hook on the input embedding, with the
attention mask from the model's own forward when it has one. Padding is dropped by the attention mask
(else the pad id at either end), each row is split into segments at the model's special tokens (BOS,
EOS, SEP, CLS, pad), and each segment leaves fingerprints: its windows of ``WINDOW`` tokens, or, when it is
``WINDOW`` tokens or shorter, the segment itself and the segment less its first or its last token. A step
is over the budget when any of its fingerprints was already exported ``budget`` times; an export counts
once against each of its fingerprints. So one sentence counts as the same example when it comes back
without its EOS, padded otherwise, cut by one token (a short sentence) or by any number (a long one,
while one window survives), inside a sliding window or packed with others between separators. Text
that many examples share (a template, a signature) counts once per export that carries it: it is
exposed that often. Not caught: a short sentence cut by two or more tokens, or packed with no separator.

**Persistence.** Counts and the secret salt live in a JSON file (``exposure_state``; default
``default.json`` under ``$AEGIS_CACHE_DIR`` or ``~/.cache/aegis/exposure/``), rewritten atomically under
a file lock at every export, merged with what other processes wrote, and loaded at start, so a new
Flower run, a changed configuration or a restarted client continues the same counts. A named file that
is missing or corrupt is an error, never a reset (``create_state`` makes a new one). The digests are
keyed by the salt, so the file does not let anyone without it test a guessed sentence; keep it like
the data (mode 0600).
"""
from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import json
import os
import secrets
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

WINDOW = 8  # tokens per fingerprint window
IN_MEMORY = ":memory:"  # exposure_state for simulations: counts live as long as the shield
_FORMAT, _VERSION = "aegis-exposure", 1


class ExposurePolicy(str, enum.Enum):
    """What ``mask_()`` does when a batch holds text already exported ``exposure_budget`` times.

    REFUSE:  raise (the default): the step stays refused (nothing can be exported or stepped) until its
             gradients are dropped and a fresh batch runs forward and backward.
    SILENCE: flood that step with rho = 0 (pure noise: the export carries nothing about the batch and
             does not count), so federated rounds go on while the budget holds.
    OFF:     no tracking; the preset's guarantee holds for one exposure only (``report()`` says so).
    """

    REFUSE = "refuse"
    SILENCE = "silence"
    OFF = "off"


def default_state_path() -> Path:
    root = os.environ.get("AEGIS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "aegis")
    return Path(root) / "exposure" / "default.json"


def create_state(path: str | os.PathLike) -> Path:
    """Write a new, empty exposure state (fresh salt) at ``path``; refuses to overwrite one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise FileExistsError(f"exposure state {path} exists: load it (AegisConfig(exposure_state=...)); "
                              "deleting it would restart every count from zero") from None
    with os.fdopen(fd, "w") as f:
        json.dump(_encode(secrets.token_bytes(16), Counter()), f)
    return path


def _encode(salt: bytes, counts: Counter[bytes]) -> dict:
    return {"format": _FORMAT, "version": _VERSION, "window": WINDOW, "salt": salt.hex(),
            "counts": {d.hex(): n for d, n in counts.items()}}


def _decode(path: Path, text: str) -> tuple[bytes, Counter[bytes]]:
    try:
        data = json.loads(text)
        if data["format"] != _FORMAT or data["version"] != _VERSION or data["window"] != WINDOW:
            raise ValueError(f"format {data['format']!r} v{data['version']} window {data['window']}")
        salt = bytes.fromhex(data["salt"])
        counts = Counter({bytes.fromhex(d): int(n) for d, n in data["counts"].items()})
        if len(salt) != 16 or any(len(d) != 16 or n < 1 for d, n in counts.items()):
            raise ValueError("bad salt or digest")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"exposure state {path} is corrupt ({err}): restore it from a backup. Starting a new one "
                         "(aegis.exposure.create_state) would forget every export so far") from None
    return salt, counts


class ExposureStore:
    """The salt and the counts: in memory, or in a JSON file shared by every process that names it."""

    def __init__(self, state: str | os.PathLike | None):
        self.path: Path | None = None
        if state == IN_MEMORY:
            self.salt, self.counts = secrets.token_bytes(16), Counter[bytes]()
            return
        if state is None:
            self.path = default_state_path()
            if not self.path.exists():
                create_state(self.path)
        else:
            self.path = Path(state)
            if not self.path.exists():
                raise FileNotFoundError(
                    f"exposure_state={str(state)!r} does not exist: a missing file would restart the counts. "
                    f"Create it once with aegis.exposure.create_state({str(state)!r}), or restore it")
        with self._locked():
            self.salt, self.counts = _decode(self.path, self.path.read_text())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        assert self.path is not None
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add(self, digests: set[bytes]) -> None:
        """Count one export against each digest; on disk: merged with the file's counts, written atomically."""
        if self.path is None:
            self.counts.update(digests)
            return
        with self._locked():
            salt, counts = _decode(self.path, self.path.read_text())
            if salt != self.salt:
                raise ValueError(f"exposure state {self.path} was replaced by another one (its salt changed): "
                                 "restore the original file")
            counts.update(digests)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(_encode(salt, counts), f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            self.counts = counts


def fingerprints(row: np.ndarray, special: frozenset[int]) -> list[np.ndarray]:
    """The token windows one row of ids is counted by (see the module docstring)."""
    cuts = np.flatnonzero(np.isin(row, list(special))) if special else np.empty(0, dtype=np.int64)
    out: list[np.ndarray] = []
    for segment in np.split(row, cuts):
        segment = segment[~np.isin(segment, list(special))] if special else segment
        n = len(segment)
        if n > WINDOW:
            out.extend(np.lib.stride_tricks.sliding_window_view(segment, WINDOW))
        elif n:
            out.append(segment)
            if n > 1:
                out += [segment[1:], segment[:-1]]
    return out


def _special_ids(config: object) -> frozenset[int]:
    ids: set[int] = set()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id"):
        value = getattr(config, key, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int):
                ids.add(v)
    return frozenset(ids)


class ExposureTracker:
    """Counts per fingerprint (salted token-window digest) how many masked exports carried it."""

    def __init__(self, model: nn.Module, budget: int, fresh: Callable[[], bool], state: str | os.PathLike | None):
        getter = getattr(model, "get_input_embeddings", None)
        embeddings = getter() if callable(getter) else None
        if embeddings is None:  # a plain module: its first embedding table sees the ids
            embeddings = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embeddings is None:
            raise ValueError(
                "exposure tracking needs an nn.Embedding (or model.get_input_embeddings()) to see the token "
                "ids; pass AegisConfig(exposure=ExposurePolicy.OFF) and keep each batch to one export yourself"
            )
        config = getattr(model, "config", None)
        self.pad = getattr(config, "pad_token_id", None)
        self.special = _special_ids(config)
        self.budget = budget
        self.store = ExposureStore(state)
        self._fresh = fresh  # True when the gradients of the pending forwards were dropped
        self._pending: list[_HostCopy] = []  # token ids (and masks) of this step's forwards, hashed at mask_()
        self._step_digests: set[bytes] | None = None
        self._untracked = 0  # forwards of this step that passed no token ids (inputs_embeds)
        self._mask: Tensor | None = None  # the attention mask of the model forward in progress
        self._ids_seen = True
        self._paused = 0
        self.handles = [
            embeddings.register_forward_pre_hook(self._record),
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave),
        ]

    def _active(self) -> bool:
        return not self._paused and torch.is_grad_enabled()

    def _start_step_if_fresh(self) -> None:
        if self._fresh():
            self._pending, self._step_digests, self._untracked = [], None, 0

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active():
            return
        mask = kwargs.get("attention_mask")
        self._mask = mask if isinstance(mask, Tensor) else None
        self._ids_seen = False

    def _leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._active() and not self._ids_seen:
            self._start_step_if_fresh()
            self._untracked += 1
        self._mask, self._ids_seen = None, True

    def _record(self, module: nn.Module, args: tuple) -> None:
        if not self._active() or not args or not isinstance(args[0], Tensor):
            return
        ids = args[0]
        if ids.dtype not in (torch.int64, torch.int32):
            return
        self._start_step_if_fresh()
        self._ids_seen = True
        mask = self._mask if self._mask is not None and self._mask.shape == ids.shape else None
        self._add(ids, mask)

    def _add(self, ids: Tensor, mask: Tensor | None) -> None:
        flat = ids.detach().reshape(-1, ids.shape[-1])
        self._pending.append(_HostCopy(flat, None if mask is None else mask.detach().reshape(flat.shape)))
        self._step_digests = None

    def track(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> None:
        """The ids of a step whose forward received embeddings (``inputs_embeds``), given by the user."""
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}: pass the mask of these ids")
        self._start_step_if_fresh()
        self._add(input_ids, attention_mask)
        self._untracked = 0

    def _rows(self) -> Iterator[np.ndarray]:
        for copy in self._pending:
            ids, mask = copy.wait()
            for k, row in enumerate(ids.to(torch.int64).numpy()):
                if mask is not None:
                    row = row[mask[k].numpy() != 0]
                elif self.pad is not None:
                    keep = np.flatnonzero(row != self.pad)
                    row = row[keep[0] : keep[-1] + 1] if len(keep) else row[:0]
                yield row

    def _digest(self, window: np.ndarray) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(window, dtype=np.int64).tobytes(), key=self.store.salt,
                               digest_size=16).digest()

    def paused(self) -> _Pause:
        """Forwards inside this context (the public calibration's) are not the client's examples."""
        return _Pause(self)

    def over_budget(self) -> int:
        """How many rows of the pending step hold text that would exceed the budget if it were exported."""
        if self._untracked:
            raise RuntimeError(
                "mask_() refused: a forward of this step received no token ids (inputs_embeds), so the exposure "
                "budget cannot count its examples. Call shield.track_examples(input_ids, attention_mask) with "
                "the batch's ids before mask_(), or pass AegisConfig(exposure=ExposurePolicy.OFF) and keep "
                "each example within the budget yourself")
        digests: set[bytes] = set()
        over = 0
        for row in self._rows():
            row_digests = {self._digest(w) for w in fingerprints(row, self.special)}
            over += any(self.store.counts[d] >= self.budget for d in row_digests)
            digests |= row_digests
        self._step_digests = digests
        return over

    def commit(self, carried_signal: bool) -> None:
        """The pending step was masked: count its fingerprints if the export carries their signal."""
        if carried_signal:
            if self._step_digests is None:
                self.over_budget()
            assert self._step_digests is not None
            self.store.add(self._step_digests)
        self.discard()

    def discard(self) -> None:
        self._pending, self._step_digests, self._untracked = [], None, 0

    @property
    def max_exposure(self) -> int:
        return max(self.store.counts.values(), default=0)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _HostCopy:
    """Token ids (and their mask) on their way to the host. A CUDA tensor is copied asynchronously into
    pinned memory behind an event, so neither the forward (where the copy is queued) nor ``mask_()`` (long
    after the copy finished) waits on the stream's later work; a blocking copy at ``mask_()`` would wait
    for the whole backward and leave the GPU idle while the host queues the flood and the optimizer step."""

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


class _Pause:
    def __init__(self, tracker: ExposureTracker):
        self.tracker = tracker

    def __enter__(self) -> None:
        self.tracker._paused += 1

    def __exit__(self, *exc) -> None:
        self.tracker._paused -= 1
