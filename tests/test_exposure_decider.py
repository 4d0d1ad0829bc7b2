"""The decider process: the training process hashes nothing and holds no count; a decider that dies fails
the step closed and a new one carries on from the store; a fork decides through its own decider."""
import concurrent.futures.thread
import multiprocessing as mp
import os
import signal
import sqlite3
import sys
import threading

import numpy as np
import pytest
import torch

import aegis
from aegis import exposure_decider
from aegis.exposure import IN_MEMORY, create_state
from aegis.exposure_counting import Counting
from aegis.exposure_store import ExposureStore
from families import build
from test_exposure_holes import backward, export
from test_exposure_store import FRESH, OTHER, TEXT, protected

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")
TESTS = os.path.dirname(__file__)


def _decider_pid() -> int:
    proc = exposure_decider._DECIDER._proc
    assert proc is not None and proc.poll() is None
    return proc.pid


def test_the_training_process_hashes_nothing_and_the_decider_counts(tmp_path, monkeypatch):
    def hashed_here(*args):
        raise AssertionError("a digest was computed in the training process")

    monkeypatch.setattr(Counting, "digests", hashed_here)
    model, _, shield = protected(str(create_state(tmp_path / "s.sqlite")))
    assert _decider_pid() != os.getpid()
    export(model, shield, TEXT)
    with pytest.raises(RuntimeError, match=r"exposure budget.*\(1 export\(s\) of it by this process\)"):
        export(model, shield, TEXT)
    model.zero_grad(set_to_none=True)
    assert shield.report().max_exposure == 1


def test_a_decider_killed_mid_decision_fails_the_step_and_a_new_one_keeps_the_counts(tmp_path):
    path = create_state(tmp_path / "s.sqlite")
    model, _, shield = protected(str(path))
    export(model, shield, TEXT)
    model.zero_grad(set_to_none=True)
    writer = sqlite3.connect(str(path), isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # the decider's transaction (started at the backward) waits for this one
    threading.Timer(1.0, os.kill, (_decider_pid(), signal.SIGKILL)).start()
    backward(model, OTHER)
    with pytest.raises(RuntimeError, match="decider process exited"):
        shield.mask_()
    writer.execute("ROLLBACK")
    with pytest.raises(RuntimeError, match="not masked"):
        shield.export()
    shield.mask_()  # a retry on the same gradients decides the step again, in a new decider: never uncounted
    shield.export()
    model.zero_grad(set_to_none=True)
    for text in (TEXT, OTHER):
        with pytest.raises(RuntimeError, match="exposure budget"):  # the new decider reads the store
            export(model, shield, text)
        model.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    export(model, shield, FRESH)


@pytest.mark.parametrize("state", ["file", IN_MEMORY])
def test_a_decider_killed_between_steps_is_replaced_before_the_decision(tmp_path, state):
    """A store: the ids sent to the dead decider go with the decision to a new one, which reads the counts.
    Counts kept in memory died with it: their counter refuses from then on (no fresh budget)."""
    model, _, shield = protected(IN_MEMORY if state == IN_MEMORY else str(create_state(tmp_path / "s.sqlite")))
    export(model, shield, TEXT)
    model.zero_grad(set_to_none=True)
    os.kill(_decider_pid(), signal.SIGKILL)
    exposure_decider._DECIDER._proc.wait()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="exposure budget" if state == "file" else "kept in memory.*were lost"):
            export(model, shield, TEXT)
        model.zero_grad(set_to_none=True)


def _decide_in_fork(counter, ids, parent, results):
    """No torch in the forked child (its thread pools do not survive a fork): the counter's API only."""
    try:
        pending = exposure_decider.Pending(lambda: (ids, None))
        over, _ = exposure_decider.on_worker(counter.decide, [pending], [], 1).result()
        results.put((over, _decider_pid() != parent))
    except Exception as err:
        results.put(f"error: {type(err).__name__}: {err}")


@pytest.mark.skipif(sys.platform != "linux", reason="os.fork")
@pytest.mark.parametrize("state", ["file", IN_MEMORY])
def test_a_forked_process_decides_through_its_own_decider(tmp_path, state):
    path = IN_MEMORY if state == IN_MEMORY else str(create_state(tmp_path / "s.sqlite"))
    store = ExposureStore(path)
    counter = exposure_decider.Counter(store, None, frozenset())
    ids = np.arange(10, 34)[None]
    assert exposure_decider.on_worker(counter.decide, [exposure_decider.Pending(lambda: (ids, None))], [], 1
                                      ).result() == (0, 1)
    parent = _decider_pid()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_decide_in_fork, args=(counter, ids, parent, results))
    child.start()
    outcome = results.get(timeout=120)
    child.join(timeout=60)
    if state == IN_MEMORY:  # the parent's counts are not the fork's: no fresh budget either
        assert "kept in memory" in outcome
    else:
        assert outcome == (1, True)  # its own decider, reading the parent's count from the store
    assert _decider_pid() == parent  # the parent's decider is still the parent's
    again = exposure_decider.on_worker(counter.decide, [exposure_decider.Pending(lambda: (ids, None))], [], 1)
    assert again.result()[0] == 1



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ids_reach_the_decider_from_pinned_copies(tmp_path):
    """CUDA ids go to the host behind an event and to the decider at the backward: refused the second time,
    with and without an attention mask, and a fresh batch still exports."""
    model = build("gpt2").cuda()
    config = aegis.AegisConfig(seed=3, exposure_budget=1, exposure_state=str(create_state(tmp_path / "s.sqlite")))
    shield = aegis.protect(model, config=config)
    ids, fresh = TEXT.cuda(), FRESH.cuda()
    mask = torch.ones_like(ids)
    export(model, shield, ids, mask)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="exposure budget"):
        export(model, shield, ids)
    model.zero_grad(set_to_none=True)
    assert all(t.is_cuda for t in export(model, shield, fresh).values())


def test_a_tracker_collected_inside_another_executors_submit_closes_without_a_lock(tmp_path):
    """A garbage collection can run a tracker's finalizer inside any ThreadPoolExecutor.submit, which holds
    the executors' shared lock: the finalizer takes no lock, and the close goes before the next message."""
    model, _, shield = protected(str(create_state(tmp_path / "s.sqlite")))
    finalizer = shield._exposure._closer
    done = threading.Event()

    def collected():
        with concurrent.futures.thread._global_shutdown_lock:  # as inside another executor's submit
            finalizer()
        done.set()

    threading.Thread(target=collected, daemon=True).start()
    assert done.wait(timeout=30)
    assert exposure_decider._CLOSED
    other_model, _, other = protected(str(create_state(tmp_path / "t.sqlite")))
    export(other_model, other, TEXT)
    assert not exposure_decider._CLOSED
