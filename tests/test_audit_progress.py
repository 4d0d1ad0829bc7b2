"""The audit's ETA and heartbeat: stage costs kept from earlier runs, an ETA within 30 % by the middle of a run
whose stages cost what was measured before, and a line at least every 30 s while one stage runs long."""
from __future__ import annotations

import io
import json
import time

import pytest

from aegis.audit.costs import Stage, StageCosts, family
from aegis.audit.options import AuditConfig
from aegis.audit.progress import PlainProgress, Tracker
from aegis.audit.records import AuditReport
from aegis.audit.runner import plan


class Clock:
    """A fake clock pair: wall seconds and CPU seconds advance when told."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def spend(self, cpu: float, wall_per_cpu: float) -> None:
        self.cpu += cpu
        self.wall += cpu * wall_per_cpu


def test_a_stage_measured_before_predicts_itself_and_its_neighbours(tmp_path):
    path = tmp_path / "stage-costs.json"
    costs = StageCosts(path)
    spectral = Stage("decoder", 2, "prune-90", "spectral", units=3.0)
    costs.record(spectral, 30.0)
    again = StageCosts(path)  # the next run reads what this one measured
    assert again.predict(spectral) == pytest.approx(30.0)
    # the same attack on another batch size, another member of the family, another defence of the model
    assert again.rate(Stage("decoder", 4, "prune-90", "spectral", 1.0)) == pytest.approx(20.0)  # twice the tokens
    assert again.rate(Stage("decoder", 2, "prune-50", "spectral", 1.0)) == pytest.approx(10.0)
    assert again.rate(Stage("decoder", 2, "soteria-80", "spectral", 1.0)) == pytest.approx(10.0)
    assert json.loads(path.read_text()) == {spectral.key: 10.0}
    assert family("dp-noise-0.01") == "dp-noise" and family("dp-sgd-C1-z1") == "dp-sgd" and family("none") == "none"


def test_an_unwritable_cache_keeps_no_history_and_fails_nothing(tmp_path):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")  # unwritable even for root
    costs = StageCosts(blocked / "audit" / "stage-costs.json")
    costs.record(Stage("decoder", 2, "none", "dager", 1.0), 2.0)  # no error
    assert not costs.writable and costs.rate(Stage("decoder", 2, "none", "dager", 1.0)) == 2.0


def _run(tracker: Tracker, clock: Clock, stages, actual, wall_per_cpu):
    """Run the stages on the fake clocks; return (ETA at the middle, the wall time that was really left)."""
    total_wall = sum(actual) * wall_per_cpu
    eta_mid, left_mid = None, None
    for stage, cost in zip(stages, actual):
        tracker.start(stage)
        clock.spend(cost, wall_per_cpu)
        tracker.finish(stage, cost)
        if eta_mid is None and clock.wall >= total_wall / 2:
            eta_mid, left_mid = tracker.eta(), total_wall - clock.wall
    return eta_mid, left_mid


def test_the_eta_is_within_30_percent_by_mid_run():
    """Stages that cost 0.6 to 1.8 times their prediction (a slower machine, uneven attacks), on a machine where
    a CPU second takes 1.7 wall seconds (other processes on the cores)."""
    stages = [Stage("decoder", 2, f"d{i % 7}", f"a{i}", 1.0) for i in range(40)]
    predicted = [5.0 if i % 5 else 40.0 for i in range(40)]
    actual = [p * (1.2 + 0.6 * ((i * 7) % 3 - 1)) for i, p in enumerate(predicted)]
    clock = Clock()
    tracker = Tracker(wall=lambda: clock.wall, cpu=lambda: clock.cpu)
    tracker.plan(stages, predicted)
    eta, left = _run(tracker, clock, stages, actual, wall_per_cpu=1.7)
    assert eta == pytest.approx(left, rel=0.3)
    assert tracker.share() == 1.0


def test_the_eta_follows_the_load_of_the_last_minute():
    """The cores are shared: for the first 10 of 60 stages a CPU second takes 4 wall seconds, then 1.5. The CPU
    is predicted right; the wall rate is the last minute's, so by the middle of the run the ETA holds (the
    run's average rate, 2.7 there, would overshoot by 75 %)."""
    stages = [Stage("decoder", 2, "none", f"a{i}", 1.0) for i in range(60)]
    clock = Clock()
    tracker = Tracker(wall=lambda: clock.wall, cpu=lambda: clock.cpu)
    tracker.plan(stages, [5.0] * 60)
    total_wall = 10 * 5 * 4.0 + 50 * 5 * 1.5
    eta_mid, left_mid = None, None
    for i, stage in enumerate(stages):
        tracker.start(stage)
        for _ in range(5):  # a heartbeat per CPU second
            clock.spend(1.0, 4.0 if i < 10 else 1.5)
            tracker.sample()
            if eta_mid is None and clock.wall >= total_wall / 2:
                eta_mid, left_mid = tracker.eta(), total_wall - clock.wall
        tracker.finish(stage, 5.0)
    assert eta_mid == pytest.approx(left_mid, rel=0.3)


def test_the_plan_counts_only_what_is_left_to_run():
    config = AuditConfig.quick(defences=("none", "prune-90"), attacks=("dager", "embedding_norm"))
    fresh = plan(config, AuditReport({}))
    assert [s.what for s in fresh] == ["load", "null-dager", "null-embedding_norm", "federate", "dager",
                                      "embedding_norm", "federate", "dager", "embedding_norm"]
    from aegis.audit.records import NullBaseline, Verdict

    done = AuditReport({}, nulls=[NullBaseline("decoder", "dager", 0.1), NullBaseline("decoder", "embedding_norm", 0)],
                       verdicts=[Verdict("decoder", "none", False, [], 1.0)])
    assert [(s.defence, s.what) for s in plan(config, done)] == [
        ("model", "load"), ("prune-90", "federate"), ("prune-90", "dager"), ("prune-90", "embedding_norm")]


def test_a_stage_past_its_prediction_raises_the_eta():
    clock = Clock()
    tracker = Tracker(wall=lambda: clock.wall, cpu=lambda: clock.cpu)
    stages = [Stage("decoder", 2, "none", "mlp_span", 1.0), Stage("decoder", 2, "none", "dager", 1.0)]
    tracker.plan(stages, [10.0, 10.0])
    tracker.start(stages[0])
    etas = []
    for _ in range(6):
        clock.spend(5.0, wall_per_cpu=1.0)
        etas.append(tracker.eta())
    assert etas[:2] == pytest.approx([15.0, 10.0])  # on time
    assert etas[2:] == pytest.approx([15.0, 20.0, 25.0, 30.0])  # 5, 10, 15, 20 s over: as long again, plus dager


def test_a_long_stage_prints_a_heartbeat():
    stream = io.StringIO()
    progress = PlainProgress(stream, every=5.0, quiet=0.3, tick=0.05)
    stage = Stage("decoder", 2, "aegis-sentences", "mlp_span", 1.0)
    with progress:
        hooks = progress.hooks()
        hooks.plan([stage], [10.0])
        hooks.start(stage)
        time.sleep(1.0)
    lines = stream.getvalue().splitlines()
    beats = [line for line in lines if "still working" in line]
    assert "decoder · aegis-sentences · mlp_span (ETA " in lines[0]
    assert 2 <= len(beats) <= 4, lines  # one per 0.3 s of silence
    assert "decoder · aegis-sentences · mlp_span: still working" in beats[0]
