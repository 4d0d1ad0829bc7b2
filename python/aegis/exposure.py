"""Exposure budget: how many times one piece of training text may leave the client inside an export.

The noise of independent exports averages out as sqrt(K): an attacker who receives the same text K times
(local epochs, rounds over the same client data, a server resending one model) divides the noise by
sqrt(K) and reads a signal a single export hides. Each preset promises its strength up to a number of
exposures (``AegisConfig.exposures``); the tracker counts them and the shield enforces the budget.

**The counting rule** (``exposure_counting.fingerprints``). The token ids of every forward under grad mode
since the last export are read by a forward pre-hook on the input embedding, with the attention mask from
the model's own forward when it has one. Every such forward counts (a pair or contrastive loss runs several before one
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

**Cost.** The ids are copied to the host during the forward; at a backward's first gradient a worker thread
sends them to the decider, a process of its own (``aegis.exposure_decider``) that hashes them and takes the
decision, one store transaction of the step's digests (``aegis.exposure_store``), while the backward runs:
``mask_()`` finds it taken. The training process's interpreter lock is held only to copy and send the ids.
A decision taken at the backward reserves the step's text before ``mask_()``: a step dropped after its
backward without ``mask_()`` (a GradScaler's skipped fp16 step) stays counted, over-counting on the safe
side. Forwards added after a backward (gradient accumulation) are decided at their own backward or at
``mask_()``, in the same step: text the step already counted is not counted twice. Held trackers
(``hold()``) and ``torch.distributed`` runs decide at ``mask_()``.

**Persistence** (``aegis.exposure_store``): the salt and the counts live in a store (an SQLite file and the
folder of sorted runs beside it) shared by every process that names it, and the budget decision is one
transaction of it. Under ``torch.distributed`` the ranks gather their rows, rank 0 decides for all of them,
and every rank follows.
"""
from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import Tensor, nn

from . import ranks
from .exposure_decider import Arrays, Counter, Pending, closed, on_worker
from .exposure_store import (  # noqa: F401  (the public names of the store, re-exported)
    IN_MEMORY,
    WINDOW,
    ExposureStore,
    create_state,
    default_state_path,
    digest_key,
    reset_state,
)


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


class ExposureTracker:
    """Counts per fingerprint (salted token-window digest) how many masked exports carried it.

    ``gradients()`` returns the flooded gradients: the pending examples live in them, and are forgotten
    when those are dropped. A holder that exports something other than gradients (a round's delta) holds
    the pending examples across ``zero_grad`` with ``hold()``. With ``counting=False`` (ExposurePolicy.OFF)
    it only counts the rows of the step (``rows_pending``: the batch the preset's promise is stated for)."""

    def __init__(self, model: nn.Module, budget: int, gradients: Callable[[], list[Tensor | None]],
                 state: str | None, counting: bool = True, precheck: Callable[[int], None] | None = None):
        embeddings = input_embeddings(model)
        if embeddings is None:
            raise ValueError(
                "exposure tracking needs an nn.Embedding (or model.get_input_embeddings()) to see the token "
                "ids; pass AegisConfig(exposure=ExposurePolicy.OFF) and keep each batch to one export yourself"
            )
        config = getattr(model, "config", None)
        self.budget = budget
        self.store = ExposureStore(state) if counting else None
        self._counter: Counter | None = None  # this tracker's counter in the decider process
        if self.store is not None:
            self._counter = Counter(self.store, getattr(config, "pad_token_id", None), _special_ids(config))
            on_worker(self._counter.open).result()  # the decider checks the store now, not at the first step
            self._closer = weakref.finalize(self, closed, self._counter.key)
        self._exports_here = 0  # of the store, by this process (the decider's count)
        self._rows_pending = 0
        self._gradients = gradients
        self._pending: list[Pending] = []  # this step's forwards, sent to the decider once a backward starts
        self._untracked = 0  # forwards of this step that passed no token ids (inputs_embeds)
        self._backward_seen = False  # a backward ran since the pending forwards began
        self._precheck = precheck  # raises for a step outside the preset's promise (then mask_() decides, and raises)
        self._armed = False  # a counted forward not yet in a decision: the next backward starts one
        self._decisions: list[Future[int]] = []  # this step's decisions, started at its backwards
        self._covered = 0  # the pending forwards [0, _covered) are in one of them
        self._step = 0  # the decider strips, within one step, text an earlier decision of it counted
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
        """A gradient arrived: the first of a backward sends the step's forwards and starts their decision."""
        if not self._backward_seen:
            for pending in self._pending:  # the step's forwards are in: hashed while the backward runs
                self._send(pending)
            self._backward_seen = True
        if self._armed:
            self._armed = False
            self._decide_early()

    def _decide_early(self) -> None:
        """Start the decision of the forwards no decision covers yet, so ``mask_()`` finds it taken. Not when
        ``mask_()`` would refuse the step before deciding, under ``hold()`` or torch.distributed (collectives)."""
        if self._counter is None or self._held or ranks.distributed() or self._problem():
            return
        if self._precheck is not None:
            try:
                self._precheck(self._rows_pending)
            except ValueError:
                return
        self._decisions.append(on_worker(self._decide_in_decider, self._pending[self._covered:], [], self._step))
        self._covered = len(self._pending)

    def _send(self, pending: Pending) -> None:
        if self._counter is not None and not ranks.distributed():  # under DDP rank 0 gathers them at the decision
            pending.held = True
            on_worker(self._counter.send, pending)

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
        self._armed = True
        if self._counter is not None:
            copy = _HostCopy(flat, None if mask is None else mask.detach().reshape(flat.shape))
            self._pending.append(Pending(copy.arrays))
            if self._backward_seen:  # accumulating: a backward of this step already ran
                self._send(self._pending[-1])

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
        """The budget decision of the pending step, one store transaction in the decider: the number of rows
        holding text already exported ``budget`` times (nothing counted), or 0 with every fingerprint counted
        once more. Under torch.distributed every rank's ids are gathered and rank 0 decides for all."""
        if not ranks.distributed():
            return self.decide_async().result()
        problem = self._problem()
        arrays: list[Arrays] = [] if problem else [p.arrays() for p in self._pending]
        problems, gathered = ranks.gather(problem, arrays)
        self._raise(next((p for p in problems if p), None))
        return ranks.decided_by_rank0(lambda: on_worker(self._decide_in_decider, [], gathered).result())

    def decide_async(self) -> Future[int]:
        """``decide()`` in the decider: the decisions the step's backwards started, and one for the forwards
        none covers; the caller joins it before anything is stepped or exported. A problem is raised here at
        once; under torch.distributed (collectives) it decides here too."""
        done: Future[int] = Future()
        if ranks.distributed():
            done.set_result(self.decide())
            return done
        self._raise(self._problem())
        if any(d.done() and d.exception() is not None for d in self._decisions):
            self._decisions, self._covered = [], 0  # a decision failed (its decider died): decide the step again
        rest = self._pending[self._covered:]
        if rest or not self._decisions:
            self._decisions.append(on_worker(self._decide_in_decider, rest, [], self._step))
            self._covered, self._armed = len(self._pending), False
        if len(self._decisions) == 1:
            return self._decisions[0]
        on_worker(_join, list(self._decisions), done)  # the worker runs in order: every decision before is answered
        return done

    def _decide_in_decider(self, pending: list[Pending], extra: list[Arrays], step: int | None = None) -> int:
        assert self._counter is not None  # on the worker
        over, self._exports_here = self._counter.decide(pending, extra, self.budget, step)
        return over

    def _raise(self, problem: str | None) -> None:
        if problem:
            raise RuntimeError(
                f"mask_() refused: {problem}. Call shield.track_examples(input_ids, attention_mask) with the batch's "
                "ids before mask_(), or pass AegisConfig(exposure=ExposurePolicy.OFF) and keep each example within "
                "the budget yourself")
        if self._counter is None:
            raise RuntimeError("decide(): this tracker counts rows only (ExposurePolicy.OFF)")

    def refuse(self, over: int, grads: list[Tensor | None]) -> RuntimeError:
        """The step was refused: it stays refused until these gradients are dropped (not merely changed).
        Returns the error to raise, naming the store and how much of it this process wrote."""
        self._refused = [(g, g._version) for g in grads if g is not None]
        self._decisions, self._covered = [], 0  # a retry decides the whole step again (text it counted is stripped)
        store = self.store
        where = "memory (IN_MEMORY)" if store is None or store.path is None else str(store.path)
        mine = self._exports_here
        return RuntimeError(
            f"mask_() refused: {over} example(s) of this batch hold text already exported {self.budget} time(s), the "
            f"exposure budget of this configuration (noise averages out over repeated exports), counted in {where} "
            f"({mine} export(s) of it by this process). Drop these gradients (optimizer.zero_grad()) and skip the "
            "batch, raise lam by sqrt(K/budget) and set AegisConfig(exposure_budget=K), or "
            "AegisConfig(exposure=ExposurePolicy.SILENCE) to export pure noise for such steps")

    def discard(self) -> None:
        if self._counter is not None and any(p.held for p in self._pending):  # not counted: the decider forgets them
            on_worker(self._counter.drop, self._pending)
        self._pending, self._untracked, self._backward_seen, self._refused = [], 0, False, None
        self._rows_pending, self._armed, self._decisions, self._covered = 0, False, [], 0
        self._step += 1  # a decision still running stays counted (over-counting is safe)

    def wait_durable(self) -> None:
        if self._counter is not None:
            on_worker(self._counter.durable).result()

    @property
    def max_exposure(self) -> int:
        return 0 if self._counter is None else on_worker(self._counter.max_count).result()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self._counter is not None:
            self._closer()


def _join(decisions: list[Future[int]], done: Future[int]) -> None:
    """On the worker, after every one of ``decisions`` ran: their rows over the budget, or their first error."""
    try:
        done.set_result(sum(d.result() for d in decisions))
    except BaseException as err:
        done.set_exception(err)


def _same(grad: Tensor, seen: tuple[Tensor, int]) -> bool:
    return grad is seen[0] and grad._version == seen[1]


class _HostCopy:
    """Token ids (and their mask) on their way to the host. A CUDA tensor is copied asynchronously into
    pinned memory behind an event, which the worker waits on (``arrays()``) before it sends them to the
    decider: neither the forward nor ``mask_()`` waits on the stream's later work (the backward)."""

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

    def arrays(self) -> Arrays:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors[0].numpy(), self.tensors[1].numpy() if self.has_mask else None


class _Nested:
    """A context that raises one of the tracker's counters while it is open (re-entrant)."""

    def __init__(self, tracker: ExposureTracker, counter: str):
        self.tracker, self.counter = tracker, counter

    def __enter__(self) -> None:
        setattr(self.tracker, self.counter, getattr(self.tracker, self.counter) + 1)

    def __exit__(self, *exc) -> None:
        setattr(self.tracker, self.counter, getattr(self.tracker, self.counter) - 1)
