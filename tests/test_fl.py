"""Flower integration (aegis.fl): AegisMod fails closed, FedSGD aggregates exactly, rounds run without Ray."""
import copy
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import transformers
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict

from aegis import AegisConfig, Preset, protect
from aegis.baselines import DPSGD
from aegis.defence import NoDefence, lm_loss
from aegis.fl import (
    AegisMod,
    ClientTrainer,
    FedSGD,
    InProcessGrid,
    config_from_run_config,
    digest,
    flower_runtime,
    pack_gradients,
    pack_masked,
    run_rounds,
    trainable_arrays,
)
from aegis.fl.client import REFUSAL

transformers.logging.set_verbosity_error()
README = Path(__file__).resolve().parents[1] / "python" / "aegis" / "fl" / "README.md"


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=200, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def lm_batch(batch=3, length=7, seed=1):
    ids = torch.randint(0, 200, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def context(run_config=None, node=1000):
    return Context(run_id=0, node_id=node, node_config={}, state=RecordDict(), run_config=run_config or {})


def instruction(arrays, server_round=1, node=1000):
    with flower_runtime():
        content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})})
        return Message(content, node, MessageType.TRAIN)


def global_arrays(config=None):
    """What the server sends AEGIS clients: trainable (non-attention) parameters."""
    server = tiny_gpt2()
    protect(server, None, config or AegisConfig())
    return trainable_arrays(server)


def clean_gradient(model, batch):
    return NoDefence().attach(model).step(batch)[1]


def eval_loss(model):
    with torch.no_grad():
        return {"loss": float(model(**lm_batch()).loss)}


def must_not_train(msg, ctx):
    raise AssertionError("the mod must refuse before training")


# -- AegisMod -----------------------------------------------------------------------------------
def test_mod_sends_masked_non_attention_fp32_gradient_configured_from_run_config():
    trainer = ClientTrainer(tiny_gpt2(), [lm_batch()])
    reply = AegisMod()(instruction(global_arrays()), context({"aegis-preset": "verification"}), trainer)
    assert not reply.has_error()
    record = reply.content["arrays"]
    assert record.keys() and not any(".attn." in k for k in record.keys())
    assert {a.dtype for a in record.values()} == {"float32"}
    assert reply.content["aegis"]["digest"] == digest(record)
    assert trainer._aegis.config.preset is Preset.VERIFICATION
    assert dict(reply.content["metrics"]) == {"num-examples": 1}
    clean = clean_gradient(tiny_gpt2(), lm_batch())
    shared = record["transformer.h.0.mlp.c_fc.weight"].numpy()
    assert not np.allclose(shared, clean["transformer.h.0.mlp.c_fc.weight"].numpy())


class _KeepLog(logging.Handler):
    """The reasons AegisMod logs on the client (the server reads only the constant REFUSAL)."""

    messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


logging.getLogger("aegis.fl.client").addHandler(_KeepLog())


def _error_reason(reply):
    assert reply.has_error(), "the mod let the reply through"
    assert reply.error.code == 6  # Flower's MOD_FAILED_PRECONDITION
    assert reply.error.reason == REFUSAL
    return _KeepLog.messages[-1]


def test_mod_refuses_raw_gradient_even_with_a_forged_proof():
    def leaky(msg, ctx):
        grads = clean_gradient(tiny_gpt2(), lm_batch())
        record = pack_gradients({k: v for k, v in grads.items() if ".attn." not in k})
        proof = ConfigRecord({"masked": True, "digest": digest(record)})
        return Message(
            RecordDict({"arrays": record, "aegis": proof, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg
        )

    assert "no shield masked" in _error_reason(AegisMod()(instruction(global_arrays()), context(), leaky))


def test_mod_refuses_reply_without_proof():
    def unmarked(msg, ctx):
        record = pack_gradients({"w": torch.ones(2)})
        return Message(RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    assert "not marked as masked" in _error_reason(AegisMod()(instruction(global_arrays()), context(), unmarked))


def _masked_reply(msg, config, tamper=False, metrics=None, extra=None):
    """An honest AEGIS reply (optionally tampered, with other metrics, or with extra records added)."""
    model = tiny_gpt2()
    shield = protect(model, None, config)
    model(**lm_batch()).loss.backward()
    shield.mask_()
    record, proof = pack_masked(shield)
    if tamper:
        name = next(iter(record.keys()))
        record[name] = Array(np.zeros(record[name].shape, dtype=np.float32))
    content = RecordDict({"arrays": record, "aegis": proof, "metrics": MetricRecord(metrics or {"num-examples": 1})})
    for key, value in (extra or {}).items():
        content[key] = value
    return Message(content, reply_to=msg)


def _raw_mlp_gradient():
    return clean_gradient(tiny_gpt2(), lm_batch())["transformer.h.0.mlp.c_fc.weight"]


def test_mod_refuses_arrays_changed_after_masking():
    tampered = lambda msg, ctx: _masked_reply(msg, AegisConfig(), tamper=True)  # noqa: E731
    assert "digest mismatch" in _error_reason(AegisMod()(instruction(global_arrays()), context(), tampered))
    honest = lambda msg, ctx: _masked_reply(msg, AegisConfig())  # noqa: E731
    assert not AegisMod()(instruction(global_arrays()), context(), honest).has_error()


def test_mod_refuses_masking_with_a_configuration_other_than_the_run_config():
    mine = AegisConfig(preset="sentences", allow_outside_promise=True)  # the test's batch is 3
    own = lambda msg, ctx: _masked_reply(msg, mine)  # noqa: E731
    mod = AegisMod(mine)  # the run config tightens it to verification
    reason = _error_reason(mod(instruction(global_arrays()), context({"aegis-preset": "verification"}), own))
    assert "configuration other than" in reason


def test_mod_forgetting_to_mask_fails_closed():
    def forgot(msg, ctx):
        model = tiny_gpt2()
        shield = protect(model)
        model(**lm_batch()).loss.backward()
        pack_masked(shield)  # no mask_(): export refuses

    assert "not masked" in _error_reason(AegisMod()(instruction(global_arrays()), context(), forgot))


@pytest.mark.parametrize(
    "run_config,reason",
    [
        ({"aegis-seed": 1}, "aegis-seed"),
        ({"aegis-presett": "reconstruction"}, "unknown run config key"),
        ({"aegis-preset": "strongest"}, "preset"),
        ({"aegis-preset": "utility"}, "was removed: it did not train; use 'sentences'"),
        ({"aegis-strict": "yes"}, "'aegis-strict' = 'yes': expected bool"),
    ],
)
def test_mod_refuses_bad_run_config_before_training(run_config, reason):
    assert reason in _error_reason(AegisMod()(instruction(global_arrays()), context(run_config), must_not_train))


def test_mod_sends_the_constant_refusal_for_an_error_reply():
    msg = instruction(global_arrays())
    error = Message(Error(code=2, reason="client crashed: 3 examples over budget"), reply_to=msg)
    assert "client crashed" in _error_reason(AegisMod()(msg, context(), lambda m, c: error))


def test_reply_carries_only_masked_arrays_proof_and_a_constant_weight():
    """No train-loss, no batch size, nothing else computed from the private batch."""
    for size, seed in ((3, 1), (5, 2)):
        batch = lm_batch(batch=size, seed=seed)
        trainer = ClientTrainer(tiny_gpt2(), [batch])
        reply = AegisMod()(instruction(global_arrays()), context(), trainer)
        assert not reply.has_error()
        content = reply.content
        assert set(content.keys()) == {"arrays", "aegis", "metrics"}
        assert list(content.array_records) == ["arrays"]
        assert list(content.config_records) == ["aegis"] and set(content["aegis"]) == {"masked", "digest"}
        assert list(content.metric_records) == ["metrics"]
        assert dict(content["metrics"]) == {"num-examples": 1}  # the same for 3 and 5 examples
        with torch.no_grad():
            loss = float(lm_loss(trainer.model, batch))
        for record in (*content.config_records.values(), *content.metric_records.values()):
            for value in record.values():
                assert value not in (loss, size), "a batch-derived value travels"
    undefended = ClientTrainer(tiny_gpt2(), [lm_batch()], defence=NoDefence())(
        instruction(trainable_arrays(tiny_gpt2())), context()
    )
    assert set(undefended.content.keys()) == {"arrays", "metrics"}
    assert dict(undefended.content["metrics"]) == {"num-examples": 1}


def test_clean_loss_was_an_oracle_and_the_reply_no_longer_carries_it():
    """The old `train-loss` field: with the global model, |Δloss| = 0 picks the true word order among 301."""
    words = "alice wired the rent to bob on friday".split()  # 8 distinct words: 40320 orders
    vocab = {w: 17 + 13 * i for i, w in enumerate(words)}
    order = torch.tensor([[vocab[w] for w in words]])
    batch = {"input_ids": order, "labels": order}
    server_model = tiny_gpt2()  # the honest-but-curious server holds the global model
    trainer = ClientTrainer(tiny_gpt2(seed=7), [batch], defence=NoDefence())
    reply = trainer(instruction(trainable_arrays(server_model)), context())
    with torch.no_grad():
        old_field = float(lm_loss(trainer.model, batch))  # what the reply used to carry as "train-loss"

    rng = np.random.default_rng(0)
    candidates = {tuple(range(len(words)))}
    while len(candidates) < 301:
        candidates.add(tuple(int(i) for i in rng.permutation(len(words))))
    candidates = sorted(candidates)
    with torch.no_grad():
        deltas = []
        for perm in candidates:
            ids = order[:, list(perm)]
            deltas.append(abs(float(server_model(input_ids=ids, labels=ids).loss) - old_field))
    ranking = sorted(range(len(candidates)), key=deltas.__getitem__)
    truth = candidates.index(tuple(range(len(words))))
    assert ranking[0] == truth and deltas[truth] == 0.0  # ranked 1st of 301, exactly
    assert deltas[ranking[1]] > 0.0  # no other order fits

    # The new reply carries no loss: nothing the server could rank candidates against.
    assert "train-loss" not in reply.content["metrics"]
    assert dict(reply.content["metrics"]) == {"num-examples": 1}
    for record in (*reply.content.config_records.values(), *reply.content.metric_records.values()):
        assert old_field not in list(record.values())


def test_mod_refuses_a_metrics_only_reply():
    msg = instruction(global_arrays())
    def metrics_only(m, c):
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "train-loss": 1.25})}), reply_to=m)

    reason = _error_reason(AegisMod()(msg, context(), metrics_only))
    assert "metrics-only" in reason and "reply_content" in reason
    empty = lambda m, c: Message(RecordDict(), reply_to=m)  # noqa: E731
    assert "no ArrayRecord" in _error_reason(AegisMod()(msg, context(), empty))


@pytest.mark.parametrize(
    "extra,named",
    [
        (lambda g: {"leak": ConfigRecord({"grad": g.flatten().tolist()})}, "ConfigRecord(s) ['leak']"),
        (lambda g: {"leak": MetricRecord({"grad": g.flatten().tolist()})}, "MetricRecord(s) ['leak']"),
    ],
    ids=["config-record", "metric-record"],
)
def test_mod_refuses_a_raw_gradient_smuggled_in_another_record(extra, named):
    smuggler = lambda msg, ctx: _masked_reply(msg, AegisConfig(), extra=extra(_raw_mlp_gradient()))  # noqa: E731
    reason = _error_reason(AegisMod()(instruction(global_arrays()), context(), smuggler))
    assert named in reason and "remove them" in reason


def test_mod_refuses_a_raw_gradient_smuggled_in_the_proof():
    def smuggler(msg, ctx):
        reply = _masked_reply(msg, AegisConfig())
        reply.content["aegis"]["grad"] = _raw_mlp_gradient().flatten().tolist()
        return reply

    reason = _error_reason(AegisMod()(instruction(global_arrays()), context(), smuggler))
    assert "['grad']" in reason and "proof" in reason


@pytest.mark.parametrize(
    "metrics,named",
    [
        ({"num-examples": 1, "train-loss": 5.3}, "unknown metric key(s) ['train-loss']"),
        ({"num-examples": 1, "batch-tokens": 21}, "unknown metric key(s) ['batch-tokens']"),
        ({"num-examples": 3}, "'num-examples' = 3"),  # the true batch size: computed from the private batch
        ({"num-examples": 1.0}, "'num-examples' = 1.0"),
    ],
)
def test_mod_refuses_unknown_metric_keys_and_batch_derived_weights(metrics, named):
    leaky = lambda msg, ctx: _masked_reply(msg, AegisConfig(), metrics=metrics)  # noqa: E731
    assert named in _error_reason(AegisMod()(instruction(global_arrays()), context(), leaky))


def test_mod_refuses_an_extra_or_misplaced_array_record():
    raw = lambda: pack_gradients({"w": _raw_mlp_gradient()})  # noqa: E731
    extra = lambda msg, ctx: _masked_reply(msg, AegisConfig(), extra={"raw": raw()})  # noqa: E731
    reason = _error_reason(AegisMod()(instruction(global_arrays()), context(), extra))
    assert "['arrays', 'raw']" in reason and "drop the others" in reason

    def misplaced(msg, ctx):  # the masked arrays under another key: not what the strategy reads
        reply = _masked_reply(msg, AegisConfig())
        content = RecordDict(
            {"grads": reply.content["arrays"], "aegis": reply.content["aegis"], "metrics": reply.content["metrics"]}
        )
        return Message(content, reply_to=msg)

    assert "['grads']" in _error_reason(AegisMod()(instruction(global_arrays()), context(), misplaced))


def test_mod_rejects_a_fixed_seed_at_construction():
    # AegisConfig itself may refuse a fixed seed first ("fixed key"); either way no mod is built with one.
    with pytest.raises(ValueError, match="secret seed|fixed key"):
        AegisMod(AegisConfig(seed=3))


def test_config_from_run_config():
    base = AegisConfig(preset="sentences", rel_threshold=0.05)
    cfg = config_from_run_config({"aegis-preset": "verification", "aegis-strict": True, "lr": 0.1}, base)
    assert (cfg.preset, cfg.strict, cfg.rel_threshold) == (Preset.VERIFICATION, True, 0.05)
    server = config_from_run_config({"aegis-preset": "sentences", "aegis-rel-threshold": 0.2})  # no floor
    assert (server.preset, server.rel_threshold) == (Preset.SENTENCES, 0.2)


def test_trainer_refuses_to_run_aegis_without_the_mod():
    trainer = ClientTrainer(tiny_gpt2(), [lm_batch()])
    with pytest.raises(RuntimeError, match="AegisMod"):
        trainer(instruction(global_arrays()), context())


def test_trainer_rejects_global_arrays_that_do_not_match_its_trainable_parameters():
    trainer = ClientTrainer(tiny_gpt2(), [lm_batch()])
    everything = trainable_arrays(tiny_gpt2())  # attention included: AEGIS clients never take those
    reply = AegisMod()(instruction(everything), context(), trainer)
    assert "do not match the trainable parameters" in _error_reason(reply)


# -- FedSGD -------------------------------------------------------------------------------------
SHAPES = {"w": (2, 3), "b": (3,)}


def arrays_of(values):
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in values.items()})


def grid_with(nodes):
    return InProcessGrid({n: must_not_train for n in nodes}, {n: context(node=n) for n in nodes})


def reply(msg, grads, n, **metrics):
    content = RecordDict({"arrays": arrays_of(grads), "metrics": MetricRecord({"num-examples": n, **metrics})})
    return Message(content, reply_to=msg)


def random_values(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def test_fedsgd_step_is_the_weighted_mean_gradient_times_lr():
    w0 = random_values(0)
    strategy = FedSGD(lr=0.5)
    with flower_runtime():
        messages = list(strategy.configure_train(1, arrays_of(w0), ConfigRecord(), grid_with([1000, 1001, 1002, 1003])))
    assert len(messages) == 4
    assert all(
        m.metadata.message_type == MessageType.TRAIN and m.content["config"]["server-round"] == 1 for m in messages
    )
    grads, sizes = [random_values(s) for s in (1, 2, 3)], [1, 2, 5]
    replies = [reply(m, g, n, **{"train-loss": 2.0}) for m, g, n in zip(messages, grads, sizes)]  # node 4 never answers
    new, metrics = strategy.aggregate_train(1, replies)
    for k in SHAPES:
        mean = sum(n * g[k] for n, g in zip(sizes, grads)) / sum(sizes)
        np.testing.assert_allclose(new[k].numpy(), w0[k] - 0.5 * mean, rtol=1e-6, atol=1e-6)
    assert "train-loss" not in metrics  # a client metric is never aggregated into the round's record
    assert (
        metrics["clients-ok"],
        metrics["clients-failed"],
        metrics["clients-rejected"],
        metrics["clients-missing"],
    ) == (3, 0, 0, 1)


def test_fedsgd_adamw_keeps_optimizer_state_across_rounds():
    w0 = random_values(0)
    strategy = FedSGD(optimizer="adamw", lr=0.01, weight_decay=0.1)
    reference = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in w0.items()}
    ref_opt = torch.optim.AdamW(reference.values(), lr=0.01, weight_decay=0.1)
    arrays = arrays_of(w0)
    grid = grid_with([1000, 1001])
    for server_round in (1, 2, 3):
        with flower_runtime():
            messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        grads = [random_values(10 * server_round + i) for i in range(2)]
        arrays, _ = strategy.aggregate_train(server_round, [reply(m, g, 4) for m, g in zip(messages, grads)])
        for k, p in reference.items():
            p.grad = torch.from_numpy((grads[0][k] + grads[1][k]) / 2)
        ref_opt.step()
        for k, p in reference.items():
            np.testing.assert_allclose(arrays[k].numpy(), p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_fedsgd_skips_and_counts_failed_malformed_and_missing_clients():
    w0 = random_values(0)
    strategy = FedSGD(lr=1.0)
    with flower_runtime():
        messages = list(strategy.configure_train(1, arrays_of(w0), ConfigRecord(), grid_with(range(1000, 1007))))
    good = random_values(5)
    nan = random_values(6)
    nan["w"][0, 0] = np.nan
    replies = [
        reply(messages[0], good, 2),
        Message(Error(code=2, reason="boom"), reply_to=messages[1]),
        reply(messages[2], {"w": good["w"]}, 2),  # missing a key
        reply(messages[3], {**good, "w": np.zeros((3, 2))}, 2),  # wrong shape
        reply(messages[4], nan, 2),  # non-finite
        reply(messages[5], good, 0),  # no weight
    ]  # messages[6]: never answered
    new, metrics = strategy.aggregate_train(1, replies)
    for k in SHAPES:
        np.testing.assert_allclose(new[k].numpy(), w0[k] - good[k], rtol=1e-6, atol=1e-6)
    assert (
        metrics["clients-ok"],
        metrics["clients-failed"],
        metrics["clients-rejected"],
        metrics["clients-missing"],
    ) == (1, 1, 4, 1)
    none, metrics = strategy.aggregate_train(1, replies[1:])
    assert none is None and metrics["clients-ok"] == 0


def test_fedsgd_rejects_unknown_optimizer():
    with pytest.raises(ValueError, match="optimizer"):
        FedSGD(optimizer="lion")


# -- in-process rounds --------------------------------------------------------------------------
def client_data(clients=2, per_client=2):
    return [[lm_batch(batch=2 + c, length=6, seed=10 * c + i) for i in range(per_client)] for c in range(clients)]


def test_run_rounds_captures_exactly_what_undefended_clients_share_and_steps_fedsgd():
    model = tiny_gpt2()
    data = client_data()
    initial = copy.deepcopy(model.state_dict())
    run = run_rounds(model, data, rounds=1, lr=0.1, eval_fn=eval_loss)
    assert run.defence == "none"
    assert [s.client for s in run.captured[0]] == [0, 1]
    clean = [clean_gradient(tiny_gpt2(), data[c][0]) for c in range(2)]
    for shared in run.captured[0]:
        assert shared.batch is data[shared.client][0]
        assert shared.metrics == {"num-examples": 1}  # not the batch size (2 + client): a public constant
        assert shared.grads.keys() == clean[shared.client].keys()
        for k, g in shared.grads.items():
            assert torch.equal(g, clean[shared.client][k]), k  # the server sees the exact gradient
    for k, v in model.state_dict().items():
        assert torch.equal(v, initial[k])  # the caller's model is untouched
    params = dict(run.model.named_parameters())
    for k, p0 in tiny_gpt2().named_parameters():
        mean = (clean[0][k] + clean[1][k]) / 2  # every client weighs 1
        torch.testing.assert_close(params[k].detach(), p0.detach() - 0.1 * mean, rtol=1e-5, atol=1e-6)
    assert len(run.utility) == 2 and run.rounds[0]["clients-ok"] == 2
    assert run.rounds[0]["loss"] == run.utility[1]["loss"]  # the server's own loss, no client's
    assert "train-loss" not in run.rounds[0]


def test_run_rounds_with_aegis_shares_only_masked_gradients_and_survives_faults():
    data = client_data(clients=3)
    rounds_seen = []
    run = run_rounds(
        tiny_gpt2(), data, rounds=2, defence="aegis-verification", lr=0.05,
        eval_fn=eval_loss,
        faults={(1, 1): "raise", (2, 2): "absent"}, on_round=rounds_seen.append,
    )
    assert run.defence == "aegis-verification" and rounds_seen == [1, 2]
    assert [s.client for s in run.captured[0]] == [0, 2]
    assert [s.client for s in run.captured[1]] == [0, 1]
    assert (run.rounds[0]["clients-ok"], run.rounds[0]["clients-failed"]) == (2, 1)
    assert (run.rounds[1]["clients-ok"], run.rounds[1]["clients-missing"]) == (2, 1)
    shared = run.captured[0][0]
    assert not any(".attn." in k for k in shared.grads)
    clean = clean_gradient(tiny_gpt2(), data[0][0])
    assert not torch.allclose(shared.grads["transformer.wte.weight"], clean["transformer.wte.weight"])
    assert len(run.utility) == 3 and all(math.isfinite(u["loss"]) for u in run.utility)


def test_run_rounds_baseline_factory_keeps_per_client_state():
    run = run_rounds(
        tiny_gpt2(), client_data(), rounds=2,
        defence=lambda: DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, seed=0),
    )
    assert run.defence == "dp-sgd-C1-z1"
    assert [r["steps"] for r in run.reports] == [2.0, 2.0]
    assert all(0 < r["epsilon"] < math.inf for r in run.reports)


def test_run_rounds_rejects_bad_faults():
    with pytest.raises(ValueError, match="faults"):
        run_rounds(tiny_gpt2(), client_data(), rounds=1, faults={(1, 5): "raise"})


# -- the Flower app -----------------------------------------------------------------------------
def test_documented_flower_app_config_is_valid_for_this_flwr(tmp_path):
    from flwr.common.config import validate_config  # Flower's own pyproject validator (test-only import)

    config = tomllib.loads(re.search(r"```toml\n(.*?)```", README.read_text(), re.S).group(1))
    (tmp_path / "LICENSE").write_text("Apache-2.0\n")
    ok, errors, _ = validate_config(config, check_module=True, project_dir=tmp_path)
    assert ok, errors
    assert config["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "aegis.fl.server_app:app",
        "clientapp": "aegis.fl.client_app:app",
    }


def test_earlier_app_config_names_still_resolve():
    from aegis.fl import app, client_app, server_app

    assert app.server_app is server_app.app and app.client_app is client_app.app


def test_product_path_never_imports_the_comparators():
    """aegis.fl, the shield and the defence interface run AEGIS without loading aegis.baselines."""
    code = (
        "import sys\n"
        "import aegis, aegis.defence, aegis.fl, aegis.fl.app\n"
        "from aegis.fl import run_rounds\n"
        "import torch, transformers\n"
        "cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)\n"
        "torch.manual_seed(0)\n"
        "ids = torch.randint(0, 50, (2, 5))\n"
        "batch = {'input_ids': ids, 'labels': ids}\n"
        "run = run_rounds(transformers.GPT2LMHeadModel(cfg), [[batch], [batch]], rounds=1, defence='aegis')\n"
        "assert len(run.captured[0]) == 2\n"
        "print('aegis.baselines' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_simulate_runs_the_app_server_and_clients_in_process():
    from aegis.fl import simulate

    server, grid = simulate(2, {"num-server-rounds": 1, "model-layers": 1, "model-width": 32, "model-heads": 2})
    losses = server.state["evaluation"]["validation-loss"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert sorted(d.node_id for d in grid.deliveries) == [1000, 1001]
    for d in grid.deliveries:
        assert not d.reply.has_error()
        assert set(d.reply.content.keys()) == {"arrays", "aegis", "metrics"}
        assert dict(d.reply.content["metrics"]) == {"num-examples": 1}
        assert d.reply.content["aegis"]["masked"] is True
        assert not any(".attn." in k for k in d.reply.content["arrays"].keys())


@pytest.mark.slow
def test_flwr_run_with_the_simulation_runtime(tmp_path):
    """The documented app project, run by the real `flwr run` on a SuperLink we start (needs Ray)."""
    pytest.importorskip("ray")
    import os
    import signal
    import socket
    import subprocess
    import sys

    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "flower-superlink")):
        pytest.skip("Flower's console scripts are not installed beside this Python")
    project, home = tmp_path / "app", tmp_path / "flwr-home"
    project.mkdir(), home.mkdir()
    (project / "pyproject.toml").write_text(re.search(r"```toml\n(.*?)```", README.read_text(), re.S).group(1))
    (project / "LICENSE").write_text("Apache-2.0\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    # Run the apps in this environment (where aegis is installed) instead of a fresh per-run one.
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    superlink = subprocess.Popen(
        [os.path.join(bin_dir, "flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        run = subprocess.run(
            [os.path.join(bin_dir, "flwr"), "run", str(project), "test", "--stream",
             "--run-config", "num-server-rounds=2 model-layers=1 model-width=32 model-heads=2",
             "--federation-config", "num-supernodes=2"],
            env=env, capture_output=True, text=True, timeout=500,
        )
    finally:
        os.killpg(superlink.pid, signal.SIGTERM)  # the SuperLink and the SuperExec it started
        superlink.wait(timeout=30)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert log.count("'clients-ok': 2") == 2, log[-3000:]
    assert "'clients-failed': 0" in log and "validation-loss" in log
