"""The client's own AEGIS configuration is a floor (aegis.fl.floor, aegis.fl.node): a run config (the server's)
that would relax it is refused with the constant refusal, one that tightens it is taken; the shipped apps take
the node's pinned preset and refuse a batch size outside its promise; a node keeps a bounded number of runs;
replies leave no earlier than the node's reply floor."""
import logging
import re
import time

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from aegis import AegisConfig, Preset, protect
from aegis.config import FROZEN, VERIFICATION, simulated_client
from aegis.exposure import IN_MEMORY, ExposurePolicy, create_state
from aegis.fl import AegisMod, ClientTrainer, config_from_run_config, flower_runtime, trainable_arrays
from aegis.fl.client import REFUSAL
from aegis.fl.node import ReplyFloor
from test_fl import context, global_arrays, instruction, lm_batch, must_not_train, tiny_gpt2

TINY = {"model-layers": 1, "model-width": 32, "model-heads": 2}  # the app's decoder, random, small


@pytest.fixture(autouse=True)
def node_store(tmp_path, monkeypatch):
    """A deployed node names its exposure store (here through its environment)."""
    path = str(create_state(tmp_path / "node-store.sqlite"))
    monkeypatch.setenv("AEGIS_EXPOSURE_STATE", path)
    return path


@pytest.fixture
def client_log(caplog):
    """The reasons a client logs (the server reads only the constant REFUSAL)."""
    caplog.set_level(logging.WARNING, logger="aegis.fl")
    return caplog


def refused_because(reply, client_log) -> str:
    assert reply.has_error(), "the client sent a reply"
    assert reply.error.reason == REFUSAL  # the same constant whatever the reason
    return client_log.records[-1].getMessage()


# -- the floor: AegisMod ------------------------------------------------------------------------------
@pytest.mark.parametrize("floor, run_config, named", [
    (AegisConfig(), {"aegis-preset": "sentences"}, "'aegis-preset'"),
    (AegisConfig(), {"aegis-preset": "paper"}, "'aegis-preset'"),
    (AegisConfig(preset="sentences"), {"aegis-preset": "paper"}, "'aegis-preset'"),
    (AegisConfig(preset={**VERIFICATION, "mlp": FROZEN}), {"aegis-preset": "verification"}, "'aegis-preset'"),
    (AegisConfig(), {"aegis-strict": False}, "'aegis-strict'"),
    (AegisConfig(), {"aegis-rel-threshold": 0.001}, "'aegis-rel-threshold'"),
    (AegisConfig(), {"aegis-exposure-budget": 5}, "'aegis-exposure-budget'"),
    (AegisConfig(exposure_budget=2), {"aegis-exposure-budget": 3}, "'aegis-exposure-budget'"),
    (AegisConfig(), {"aegis-exposure": "off"}, "'aegis-exposure'"),
    (AegisConfig(), {"aegis-exposure": "silence"}, "'aegis-exposure'"),
    (AegisConfig(), {"aegis-exposure-counts": "per-run"}, "'aegis-exposure-counts'"),
], ids=["sentences<verification", "paper<verification", "paper<sentences", "custom", "strict", "threshold",
        "budget", "own-budget", "policy-off", "policy-other", "counts"])
def test_a_run_config_that_relaxes_the_clients_own_configuration_is_refused(floor, run_config, named, client_log):
    reply = AegisMod(floor)(instruction(global_arrays()), context(run_config), must_not_train)
    reason = refused_because(reply, client_log)
    assert "would relax this client's own AEGIS configuration" in reason and named in reason


def test_a_run_config_that_tightens_the_floor_is_taken():
    trainer = ClientTrainer(tiny_gpt2(), [lm_batch()])
    floor = AegisConfig(preset="sentences", strict=False, exposure_state=IN_MEMORY)
    run_config = {"aegis-preset": "verification", "aegis-strict": True, "aegis-rel-threshold": 0.05,
                  "aegis-exposure": "refuse"}
    reply = AegisMod(floor)(instruction(global_arrays()), context(run_config), trainer)
    assert not reply.has_error()
    config = trainer._aegis.config
    assert (config.preset, config.strict, config.rel_threshold) == (Preset.VERIFICATION, True, 0.05)
    # verification promises 4 exports per example; the client's own budget (sentences: 1) stays
    assert config.exposures == 1 and config.promise is Preset.VERIFICATION.promise


def test_the_floor_rules_key_by_key():
    floor = AegisConfig(exposure_budget=3)
    assert config_from_run_config({"aegis-exposure-budget": 2}, floor).exposures == 2
    assert config_from_run_config({"aegis-exposure-budget": 3}, floor).exposures == 3
    untracked = AegisConfig(exposure=ExposurePolicy.OFF)
    assert config_from_run_config({"aegis-exposure": "silence"}, untracked).exposure is ExposurePolicy.SILENCE
    per_run = simulated_client(AegisConfig())
    assert per_run.exposure_state == IN_MEMORY
    assert config_from_run_config({"aegis-exposure-counts": "across-runs"}, per_run).exposure_state is None
    assert config_from_run_config({"aegis-exposure-counts": "per-run"}, per_run).exposure_state == IN_MEMORY
    with pytest.raises(ValueError, match=re.escape("'aegis-exposure-counts' = 'forever'")):
        config_from_run_config({"aegis-exposure-counts": "forever"}, per_run)
    with pytest.raises(TypeError, match=re.escape("'aegis-exposure-budget' = 2.5")):
        config_from_run_config({"aegis-exposure-budget": 2.5}, floor)
    # the server's reading has no floor: it only needs the preset to know what trains
    assert config_from_run_config({"aegis-preset": "sentences"}).preset is Preset.SENTENCES


def test_outside_promise_names_the_batch_and_the_opt_out():
    sentences = AegisConfig(preset="sentences")
    assert sentences.outside_promise(8) is None and AegisConfig().outside_promise(8) is None
    assert "batch 4 is below the batch 8" in sentences.outside_promise(4)
    assert "batch 9 is above the batch 8" in AegisConfig().outside_promise(9)
    assert AegisConfig(preset={**VERIFICATION}).outside_promise(1000) is None  # a custom preset promises nothing
    with pytest.raises(ValueError, match="allow_outside_promise=True"):
        sentences.check_batch(4)
    AegisConfig(preset="sentences", allow_outside_promise=True).check_batch(4)  # the client's explicit opt-out
    with pytest.raises(ValueError, match="batch_size=0"):
        sentences.outside_promise(0)


# -- the shipped apps ----------------------------------------------------------------------------------
def app_context(run_config, node_config=None, run_id=0, node=1000):
    return Context(run_id=run_id, node_id=node, node_config=node_config or {}, state=RecordDict(),
                   run_config={**TINY, **run_config})


def app_instruction(preset="verification"):
    """What the app's server sends: the trainable arrays of its decoder under the run config's preset."""
    from aegis.fl.task import decoder

    model, _ = decoder(TINY)
    protect(model, None, AegisConfig(preset=preset, exposure=ExposurePolicy.OFF))
    with flower_runtime():
        content = RecordDict({"arrays": trainable_arrays(model), "config": ConfigRecord({"server-round": 1})})
        return Message(content, 1000, MessageType.TRAIN)


def test_the_client_app_runs_the_nodes_pinned_preset_and_refuses_a_batch_outside_its_promise(client_log, tmp_path,
                                                                                            monkeypatch):
    from aegis.fl.client_app import app

    monkeypatch.delenv("AEGIS_PRESET", raising=False)
    pinned = {"aegis-preset": "sentences"}
    small = app_context({"aegis-preset": "sentences", "batch-size": 4}, pinned)
    assert "batch 4 is below the batch 8" in refused_because(app(app_instruction("sentences"), small), client_log)
    ok = app(app_instruction("sentences"), app_context({"aegis-preset": "sentences", "batch-size": 8}, pinned))
    assert not ok.has_error() and set(ok.content.keys()) == {"arrays", "aegis", "metrics"}
    # unpinned, the node runs the default (verification): the server cannot choose sentences for it
    unpinned = app_context({"aegis-preset": "sentences", "batch-size": 8})
    assert "'aegis-preset'" in refused_because(app(app_instruction("sentences"), unpinned), client_log)
    monkeypatch.setenv("AEGIS_PRESET", "sentences")  # the node's environment pins it too (on another machine:
    other = str(create_state(tmp_path / "other-node.sqlite"))  # this one exported the batch already)
    monkeypatch.setenv("AEGIS_EXPOSURE_STATE", other)
    assert not app(app_instruction("sentences"), app_context(unpinned.run_config, run_id=1)).has_error()


def test_the_secure_app_takes_the_floor_from_the_node_not_the_server(client_log, monkeypatch):
    from aegis.fl.secure.app import PIN_ENV, client_train

    monkeypatch.delenv(PIN_ENV, raising=False)
    monkeypatch.delenv("AEGIS_PRESET", raising=False)
    weaker = app_context({"secure": True, "aegis-preset": "sentences", "batch-size": 8}, {"aegis-min-survivors": 2})
    reply = client_train(app_instruction("sentences"), weaker)
    assert "'aegis-preset'" in refused_because(reply, client_log)
    small = app_context({"secure": True, "aegis-preset": "sentences", "batch-size": 4},
                        {"aegis-min-survivors": 2, "aegis-preset": "sentences"})
    assert "batch 4 is below the batch 8" in refused_because(client_train(app_instruction("sentences"), small),
                                                             client_log)


# -- bounded state ---------------------------------------------------------------------------------------
def test_a_node_keeps_the_models_of_its_most_recent_runs_only(monkeypatch):
    from aegis.fl import client_app

    monkeypatch.setattr(client_app, "decoder", lambda s: (tiny_gpt2(), None))
    monkeypatch.setattr(client_app, "train_batches", lambda tok, part, parts, size: [lm_batch()])
    for run in range(100):
        client_app.trainer(app_context({}, run_id=run, node=7))
    assert len(client_app._TRAINERS) == 4  # the default
    for run in range(100, 200):
        client_app.trainer(app_context({}, {"aegis-max-runs": 2}, run_id=run, node=7))
    assert len(client_app._TRAINERS) == 2 and client_app._TRAINERS.runs() == [198, 199]


def test_a_secure_node_keeps_the_state_of_its_most_recent_runs_only(monkeypatch):
    from aegis.fl.secure import SurvivorPin
    from aegis.fl.secure import app as secure_app

    monkeypatch.setattr(secure_app, "decoder", lambda s: (tiny_gpt2(), None))
    monkeypatch.setattr(secure_app, "train_batches", lambda tok, part, parts, size: [lm_batch()])
    for run in range(100):
        secure_app._node(app_context({"secure": True}, run_id=run, node=7), SurvivorPin(2), AegisConfig())
    assert len(secure_app._NODES) == 4


# -- the reply floor ----------------------------------------------------------------------------------
def test_the_reply_floor_pads_every_reply_to_the_slowest_of_its_kind():
    now, waits = [0.0], []

    def step(seconds):
        def call(msg, ctx):
            now[0] += seconds
            return msg
        return call

    def sleep(seconds):
        waits.append(seconds)
        now[0] += seconds

    floor = ReplyFloor(0.2, clock=lambda: now[0], sleep=sleep)
    msg = instruction(global_arrays())
    floor(msg, context(), step(0.05))  # the floor: waits 0.15
    floor(msg, context(), step(0.5))  # a success that trains: slower than the floor, no wait
    floor(msg, context(), step(0.01))  # a refusal at the first check: padded to the success
    assert waits == pytest.approx([0.15, 0.49])
    with pytest.raises(RuntimeError):  # a reply that raises is padded too
        floor(msg, context(), lambda m, c: (_ for _ in ()).throw(RuntimeError("boom")))
    assert waits[-1] == pytest.approx(0.5)


def test_the_client_app_replies_no_earlier_than_the_nodes_reply_floor(client_log):
    from aegis.fl.client_app import app

    start = time.monotonic()
    reply = app(app_instruction(), app_context({"aegis-preset": "paper"}, {"aegis-reply-floor": 0.5}))
    assert time.monotonic() - start >= 0.5
    assert "'aegis-preset'" in refused_because(reply, client_log)
    with pytest.raises(ValueError, match="aegis-reply-floor"):
        from aegis.fl.node import reply_floor

        reply_floor(app_context({}, {"aegis-reply-floor": -1}))


# -- the node's exposure store -------------------------------------------------------------------------
def test_a_deployed_node_without_a_named_store_is_refused(client_log, monkeypatch):
    from aegis.fl.client_app import app

    monkeypatch.delenv("AEGIS_EXPOSURE_STATE")
    reason = refused_because(app(app_instruction(), app_context({"batch-size": 8})), client_log)
    assert "'aegis-exposure-state'" in reason and "fresh container" in reason


def test_k_runs_against_one_node_export_one_batch_once(client_log):
    """A server that opens k runs on one SuperNode process gets the node's batch once: every run's shield
    decides on the node's one store."""
    from aegis.fl.client_app import app

    pinned = {"aegis-preset": "sentences"}
    replies = [app(app_instruction("sentences"), app_context({"aegis-preset": "sentences", "batch-size": 8}, pinned,
                                                             run_id=run)) for run in range(3)]
    assert not replies[0].has_error()
    for reply in replies[1:]:
        assert "exposure budget" in refused_because(reply, client_log)
