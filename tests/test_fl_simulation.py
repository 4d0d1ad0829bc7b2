"""Simulated clients start fresh (aegis.fl.simulate, Flower's simulation runtime): each run counts its own
exposures unless the run config keeps the machine's counts; a run in which no client reply was accepted
ends with an error; secure runs state (epsilon, delta) at the end."""
import logging
import sys
import types

import pytest
from flwr.app import Context, RecordDict

from aegis.exposure import IN_MEMORY
from aegis.fl import simulate
from aegis.fl.node import SIMULATION_MODULES, node_floor, simulated

TINY = {"model-layers": 1, "model-width": 32, "model-heads": 2, "num-server-rounds": 1}
# nodes that run `sentences` (budget: one export per example) at its batch of 8
SENTENCES = {**TINY, "aegis-preset": "sentences", "batch-size": 8}
PINNED = {"aegis-preset": "sentences"}


def accepted(grid) -> int:
    return sum(not d.reply.has_error() for d in grid.deliveries)


def test_two_simulations_in_a_row_both_train(monkeypatch):
    monkeypatch.delenv("AEGIS_PRESET", raising=False)
    for _ in range(2):  # the second run exports the same batches again: its own counts, not the first run's
        server, grid = simulate(2, SENTENCES, node_config=PINNED)
        assert accepted(grid) == 2
        losses = server.state["evaluation"]["validation-loss"]
        assert losses[1] != losses[0]


def test_a_run_config_key_keeps_the_counts_across_runs(monkeypatch):
    monkeypatch.delenv("AEGIS_PRESET", raising=False)
    across = {**SENTENCES, "aegis-exposure-counts": "across-runs"}
    _, grid = simulate(2, across, node_config=PINNED)
    assert accepted(grid) == 2
    with pytest.raises(RuntimeError, match=r"NO CLIENT REPLY WAS ACCEPTED IN 1 ROUND\(S\)"):
        simulate(2, across, node_config=PINNED)  # the machine's counts: every batch was exported once already


def test_a_run_with_no_accepted_reply_ends_loudly(monkeypatch, caplog):
    monkeypatch.delenv("AEGIS_PRESET", raising=False)
    caplog.set_level(logging.ERROR, logger="flwr")
    with pytest.raises(RuntimeError, match="NO CLIENT REPLY WAS ACCEPTED") as err:
        simulate(2, SENTENCES, quiet=False)  # the nodes run verification, the server asks for sentences
    assert caplog.records[-1].getMessage() == str(err.value)


def test_a_secure_run_takes_a_stricter_preset_and_states_its_epsilon(monkeypatch, caplog):
    monkeypatch.delenv("AEGIS_MIN_SURVIVORS", raising=False)
    monkeypatch.delenv("AEGIS_PRESET", raising=False)
    caplog.set_level(logging.INFO, logger="flwr")
    run = {**TINY, "secure": True, "min-survivors": 2, "aegis-preset": "verification"}
    server, _ = simulate(2, run, node_config={"aegis-min-survivors": 2, "aegis-preset": "sentences"}, quiet=False)
    assert list(server.state["secure"]["survivors"]) == [2]
    last = [r.getMessage() for r in caplog.records if r.name == "flwr"][-1]
    assert last.startswith("aegis secure run: (epsilon = ") and "delta = 1e-05" in last


def test_simulated_clients_count_in_memory_and_real_ones_on_disk(monkeypatch):
    monkeypatch.delenv("AEGIS_PRESET", raising=False)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert not simulated()
    with pytest.raises(ValueError, match="'aegis-exposure-state'"):
        node_floor(ctx)  # a deployed node names its store
    store = Context(run_id=1, node_id=1, node_config={"aegis-exposure-state": "/srv/node.sqlite"}, state=RecordDict(),
                    run_config={})
    assert node_floor(store).exposure_state == "/srv/node.sqlite"
    monkeypatch.setitem(sys.modules, SIMULATION_MODULES[0], types.ModuleType(SIMULATION_MODULES[0]))
    assert simulated() and node_floor(ctx).exposure_state == IN_MEMORY
