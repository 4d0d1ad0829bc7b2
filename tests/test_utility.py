"""The utility harness's pieces on a tiny model (fast): schedule, client split, batch streams, macro-F1,
the shield's count of silenced steps, FedSGD / FedAvg runs, the result file, figures and page.

The AEGIS runs here swap the flood's ChaCha normals for a keyed ``torch.randn`` (``fast_noise``): what
they check (which steps the exposure budget silences) does not depend on the noise stream."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as T

from aegis.audit.options import UsageError
from aegis.audit.runner import batch_builder
from aegis.config import AegisConfig, Preset
from aegis.data import LABELS, Example, load_corpus
from aegis.defence import Aegis
from aegis.exposure import IN_MEMORY, ExposurePolicy
from aegis.harness.evaluate import evaluator, macro_f1
from aegis.models import minilm_tokenizer
from aegis.utility import Algorithm, UtilityConfig
from aegis.utility.federation import _round_batches, federate, lr_at
from aegis.utility.results import merge, statements, summarise
from aegis.utility.split import BatchStream, dirichlet_split
from fast_noise import fast_noise  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def tok():
    return minilm_tokenizer()


def tiny_decoder(tok, seed=0):
    torch.manual_seed(seed)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64, vocab_size=tok.vocab_size,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    model = T.GPT2LMHeadModel(cfg).eval()
    model.loss_type = "ForCausalLM"
    return model


# -- schedule, split, streams ----------------------------------------------------------------------------------


def test_schedule_warms_up_then_decays_to_the_floor():
    config = UtilityConfig(rounds=100, lr=1e-3, warmup=0.1, min_lr_share=0.1)
    lrs = [lr_at(r, config) for r in range(1, 101)]
    assert lrs[:10] == pytest.approx([1e-3 * r / 10 for r in range(1, 11)])
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # non-increasing after the warmup
    assert lrs[-1] == pytest.approx(1e-4)
    assert max(lrs) == pytest.approx(1e-3)


def test_dirichlet_split_is_disjoint_complete_seeded_and_skewed():
    train = load_corpus("train")
    shards = dirichlet_split(train, 8, 0.5, seed=3, min_size=4)
    assert sorted(id(e) for s in shards for e in s) == sorted(id(e) for e in train)
    assert min(map(len, shards)) >= 4
    again = dirichlet_split(train, 8, 0.5, seed=3, min_size=4)
    assert [[e.text for e in s] for s in shards] == [[e.text for e in s] for s in again]
    # non-identical: the clients' topic shares differ far beyond what an even split allows
    shares = [[sum(e.label == lab for e in s) / len(s) for lab in LABELS] for s in shards]
    assert max(max(row) for row in shares) - min(min(row) for row in shares) > 0.5
    with pytest.raises(UsageError, match="--clients"):
        dirichlet_split(train, 100, 0.5, seed=0, min_size=4)


def test_batch_stream_epochs_and_fedavg_rounds_use_distinct_examples():
    shard = [Example(f"sentence {i}", "chat") for i in range(10)]
    stream = BatchStream(shard, 3, seed=1)
    assert stream.per_epoch == 3
    for epoch in range(3):
        seen = [e.text for i in range(3) for e in stream.batch(epoch * 3 + i)]
        assert len(set(seen)) == 9
    for r in range(1, 7):  # E = 3 distinct batches per round, one local epoch each
        texts = [e.text for i in _round_batches(stream, r, 3) for e in stream.batch(i)]
        assert len(set(texts)) == 9


def test_macro_f1_by_hand():
    truth = torch.tensor([0, 0, 1, 1, 2])
    pred = torch.tensor([0, 1, 1, 1, 0])
    # class 0: tp 1 fp 1 fn 1 -> 0.5; class 1: tp 2 fp 1 fn 0 -> 0.8; class 2: tp 0 fn 1 -> 0
    assert macro_f1(pred, truth, 4) == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    assert macro_f1(truth, truth, 3) == 1.0


def test_config_errors_name_the_option():
    with pytest.raises(UsageError, match="--defences"):
        UtilityConfig(defences=("aegis-best",))
    with pytest.raises(UsageError, match="--attack-clients"):
        UtilityConfig(attack_clients=-1)
    with pytest.raises(ValueError):
        UtilityConfig(algorithms=("fedprox",))
    assert UtilityConfig(rounds=300).attacked_rounds() == (1, 150, 300)
    assert UtilityConfig.quick().attacked_rounds() == (1, 2, 3)


# -- exposure ---------------------------------------------------------------------------------------------------


def test_the_shield_counts_the_steps_it_silences(tok, fast_noise):
    """The run's silenced-step count is the shield's own: the budget of 4 runs out in epoch 5."""
    model = tiny_decoder(tok)
    build = batch_builder("decoder", tok, {})
    defence = Aegis(AegisConfig(preset="verification", exposure=ExposurePolicy.SILENCE,
                                exposure_state=IN_MEMORY)).attach(model)
    stream = BatchStream([Example(f"note number {i} for the clinic") for i in range(6)], 2, seed=0)
    counts = []
    for i in range(15):  # 5 epochs of 3 batches
        for p in model.parameters():
            p.grad = None
        defence.backward(build(stream.batch(i)))
        defence.defend_()
        counts.append(defence.shield.silenced_steps)
    assert counts == [0] * 12 + [1, 2, 3]
    assert defence.shield.report().silenced_steps == 3


# -- runs -------------------------------------------------------------------------------------------------------


# The preset that trains, at an exposure budget of one export per example (set here, not read from the promise).
BUDGET_ONE = AegisConfig(preset=Preset.SENTENCES, exposure_budget=1)


@pytest.fixture(scope="module")
def tiny_setup(tok):
    train = load_corpus("train")[:48]
    validation = load_corpus("validation")[:16]
    build = batch_builder("decoder", tok, {})
    shards = dirichlet_split(train, 2, 1.0, seed=0, min_size=4)
    return tiny_decoder(tok), build, shards, evaluator("decoder", build, validation, len(LABELS))


@pytest.mark.parametrize("algorithm", [Algorithm.FEDSGD, Algorithm.FEDAVG])
def test_undefended_run_learns_and_keeps_the_promised_points(tiny_setup, algorithm):
    model, build, shards, evaluate = tiny_setup
    config = UtilityConfig(clients=2, rounds=4, batch_size=4, local_steps=2, eval_every=2, lr=3e-2, warmup=0.0,
                           attack_clients=1)
    log = federate(model, "none", shards, build, evaluate, algorithm, config, torch.device("cpu"))
    assert [p["round"] for p in log.curve] == [0, 2, 4]
    assert log.curve[-1]["perplexity"] < 0.8 * log.curve[0]["perplexity"]
    assert sorted(log.models) == [1, 2, 4] and {c.round for c in log.captures} == {1, 2, 4}
    assert all(c.client == 0 for c in log.captures)
    steps = 1 if algorithm is Algorithm.FEDSGD else 2
    assert all(len(c.examples) == 4 * steps for c in log.captures)
    assert log.steps == 2 * 4 * steps and log.silenced_steps == 0


def test_budget_one_silences_every_export_after_one_epoch(tiny_setup, fast_noise):
    """Budget 1: each client's second pass over its data is silenced, and the run reports it exactly."""
    model, build, _, evaluate = tiny_setup
    shards = dirichlet_split(load_corpus("train")[:24], 2, 1.0, seed=0, min_size=4)
    config = UtilityConfig(clients=2, rounds=5, batch_size=4, eval_every=5, lr=1e-2, attack_clients=0)
    log = federate(model, BUDGET_ONE, shards, build, evaluate, Algorithm.FEDSGD, config, torch.device("cpu"))
    epochs = [len(s) // 4 for s in shards]
    expected = sum(max(0, 5 - e) for e in epochs)
    assert expected > 0
    assert log.silenced_steps == log.silenced_exports == expected
    assert log.exports == 10 and log.captures == []


@pytest.fixture
def zero_noise(monkeypatch):
    """The flood's normals set to zero: a silenced export (rho = 0) is then exactly zero and one that carries
    its batch is not, so what the shield did shows in the export itself, not in the harness's count."""
    import aegis_kernels.reference as reference

    def zeros(n, key, offset, per, device):
        return torch.zeros(n, device=device), (torch.zeros(n, device=device) if per == 2 else None)

    monkeypatch.setattr(reference, "noise_components", zeros)


@pytest.mark.parametrize("exposure", [ExposurePolicy.SILENCE, ExposurePolicy.OFF])
def test_exposure_off_exports_every_batch_and_silence_does_not(tiny_setup, zero_noise, exposure):
    """Budget 1, five FedSGD rounds over about three batches per client: SILENCE empties the repeats' exports,
    OFF carries every batch (the noise-alone measurement) and reports nothing silenced."""
    model, build, _, evaluate = tiny_setup
    shards = dirichlet_split(load_corpus("train")[:24], 2, 1.0, seed=0, min_size=4)
    config = UtilityConfig(clients=2, rounds=5, batch_size=4, eval_every=5, lr=1e-2, attack_clients=2,
                           exposure=exposure)
    log = federate(model, BUDGET_ONE, shards, build, evaluate, Algorithm.FEDSGD, config, torch.device("cpu"))
    epochs = [len(s) // 4 for s in shards]
    carried = {(c.round, c.client): bool(c.grads["transformer.h.0.mlp.c_fc.weight"].any()) for c in log.captures}
    fresh = {(r, c): r <= epochs[c] for r, c in carried}  # budget 1: a client's first epoch is fresh
    assert not all(fresh.values())  # some attacked export repeats its examples
    if exposure is ExposurePolicy.OFF:
        assert all(carried.values()) and log.silenced_steps == log.silenced_exports == 0
    else:
        assert carried == fresh and log.silenced_exports == sum(max(0, 5 - e) for e in epochs)


def test_exposure_setting_is_recorded_checked_and_merged_apart():
    assert UtilityConfig().as_dict()["exposure"] == "silence"
    assert UtilityConfig(exposure=ExposurePolicy.OFF).as_dict()["exposure"] == "off"
    with pytest.raises(UsageError, match="--exposure"):
        UtilityConfig(exposure=ExposurePolicy.REFUSE)  # a long run would stop at the first repeat
    silence = _result()
    off = _result(settings=UtilityConfig(rounds=2, clients=2, exposure=ExposurePolicy.OFF).as_dict())
    with pytest.raises(ValueError, match="exposure"):
        merge(silence, off)
    older = _result(settings={k: v for k, v in silence["settings"].items() if k != "exposure"})
    assert merge(older, silence)["settings"]["exposure"] == "silence"  # files from before the option


# -- results, figures, page ---------------------------------------------------------------------------------------


def _result(defences=("none", "aegis-sentences"), ppl=(100.0, 104.0), settings=None):
    runs = []
    for d, value in zip(defences, ppl):
        runs.append({
            "model": "decoder", "algorithm": "fedsgd", "defence": d, "metric": "perplexity",
            "curve": [{"round": 0, "perplexity": 500.0}, {"round": 2, "perplexity": value}],
            "final": {"round": 2, "perplexity": value}, "silenced_export_share": 0.25 if d != "none" else 0.0,
            "epsilon": None, "seconds_per_round": 1.0,
            "attacks": [{"attack": "dager", "round": 1, "score": 0.9 if d == "none" else 0.0, "null": 0.0,
                         "privacy": 0.9 if d == "none" else 0.0, "excess": 0.85 if d == "none" else -0.05,
                         "above_bar": d == "none", "leaks": d == "none"},
                        {"attack": "labels", "skipped": "encoder only"}],
        })
    settings = settings or UtilityConfig(rounds=2, clients=2).as_dict()
    result = {"settings": settings, "runs": runs, "machine": {"device": "cpu"}, "attacked_rounds": [1, 2],
              "data": {"validation_used": 16}, "nulls": [],
              "references": [{"model": "decoder", "metric": "perplexity", "untrained": {"perplexity": 500.0}}]}
    result["summary"] = summarise(result)
    result["statements"] = statements(result["summary"], runs)
    return result


def test_summary_applies_the_bar():
    rows = {s["defence"]: s for s in _result(ppl=(100.0, 104.0))["summary"]}
    assert rows["aegis-sentences"]["meets_utility"] and rows["aegis-sentences"]["meets_privacy"]
    assert rows["aegis-sentences"]["meets_both"] and not rows["none"]["meets_privacy"]
    assert rows["aegis-sentences"]["ratio"] == pytest.approx(1.04)
    worse = {s["defence"]: s for s in _result(ppl=(100.0, 106.0))["summary"]}
    assert not worse["aegis-sentences"]["meets_utility"]
    line = _result(ppl=(100.0, 106.0))["statements"][0]
    assert "meets it: none" in line and "aegis-sentences (utility 1.06x undefended)" in line


def test_merge_replaces_runs_and_refuses_other_settings():
    old = _result()
    new = _result(defences=("aegis-sentences",), ppl=(120.0,))
    merged = merge(old, new)
    assert [(r["defence"], r["final"]["perplexity"]) for r in merged["runs"]] == [("none", 100.0),
                                                                                ("aegis-sentences", 120.0)]
    other = _result(settings=UtilityConfig(rounds=4, clients=2).as_dict())
    with pytest.raises(ValueError, match="rounds"):
        merge(old, other)


def test_figures_and_page_are_written(tmp_path):
    from aegis.utility.study import write_outputs

    result = _result()
    paths = write_outputs(result, tmp_path)
    assert [p.name for p in paths] == ["report.json", "learning_curves.png", "frontier.png", "report.html"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert json.loads(paths[0].read_text())["utility"]["runs"][0]["defence"] == "none"
    page = paths[3].read_text()
    assert "learning_curves.png" in page and "frontier.png" in page and "25%" in page
    assert result["statements"][0].split(":")[0] in page
    assert not math.isnan(result["summary"][1]["ratio"])
    assert "not a private setting" not in page


def test_page_says_exposure_off_is_no_private_setting(tmp_path):
    from aegis.utility.study import write_outputs

    settings = UtilityConfig(rounds=2, clients=2, exposure=ExposurePolicy.OFF, attacks=()).as_dict()
    result = _result(settings=settings)
    result["machine"]["cpu_noise"] = "aegis_kernels.testing.keyed_normals"
    page = write_outputs(result, tmp_path)[3].read_text()
    assert "no attacks run." in page and "exports at rounds" not in page
    assert "Exposure budget OFF: a measurement of the noise alone, not a private setting" in page
    assert "aegis_kernels.testing.keyed_normals (not the ChaCha stream)" in page


def test_page_names_the_algorithms_the_study_ran(tmp_path):
    from aegis.utility.study import write_outputs

    for algorithms, present, absent in ((("fedsgd",), "FedSGD (one step per round)", "FedAvg"),
                                        (("fedavg",), "FedAvg with E = 2 local steps", "FedSGD"),
                                        (("fedsgd", "fedavg"), "FedSGD (one step per round) and FedAvg", None)):
        settings = UtilityConfig(rounds=2, clients=2, local_steps=2, algorithms=algorithms).as_dict()
        page = write_outputs(_result(settings=settings), tmp_path / "_".join(algorithms))[3].read_text()
        assert present in page and (absent is None or absent not in page.split("clients (Dirichlet")[1][:400])


def test_cli_refuses_bad_options_in_one_line():
    from typer.testing import CliRunner

    from aegis.cli import app

    for args, option in ((["--device", "gpu"], "--device"), (["--algorithms", "fedprox"], "--algorithms"),
                         (["--clients", "0"], "--clients"), (["--defences", "aegis-best"], "--defences"),
                         (["--exposure", "refuse"], "--exposure")):
        out = CliRunner().invoke(app, ["utility", *args])
        assert out.exit_code == 2 and f"error: {option}" in out.output, out.output


# -- calibrate ----------------------------------------------------------------------------------------------------


def test_calibrate_grid_configs_and_frontier(tok):
    from aegis.policy import plan
    from aegis.utility.calibrate import MlpMode, frontier, grid

    cands = grid((0.02, 0.04), (None, 0.01))
    assert [(c.rows_snr, c.mlp, c.mlp_snr) for c in cands] == [
        (0.02, MlpMode.FROZEN, 0.0), (0.02, MlpMode.FLOOD, 0.01),
        (0.04, MlpMode.FROZEN, 0.0), (0.04, MlpMode.FLOOD, 0.01),
    ]
    with pytest.raises(UsageError, match="--rows-snr"):
        grid((0.0,), (None,))
    treatments = {p.role: p.treatment for p in plan(tiny_decoder(tok), cands[1].config(exposures=2))}
    assert treatments["token_embedding"].snr == 0.02 and treatments["token_embedding"].kind == "rows"
    assert treatments["mlp"].kind == "matrix" and treatments["mlp"].snr == 0.01 and treatments["mlp"].rho == 1.0
    assert treatments["attention"].kind == "frozen" and treatments["norm"].kind == "frozen"
    assert cands[0].config(exposures=2).exposures == 2
    rows = [{"final": 10.0, "privacy": 0.5}, {"final": 12.0, "privacy": 0.1}, {"final": 13.0, "privacy": 0.2},
            {"final": 10.0, "privacy": 0.6}]
    frontier(rows, "perplexity")
    assert [r["frontier"] for r in rows] == [True, True, False, False]
