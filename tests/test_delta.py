"""Delta export (aegis.delta): one flood per round, sized by a public round, counted once per example."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import aegis.delta as delta_mod
import aegis_kernels.reference as ref
from aegis.calibration import delta_params
from aegis.config import FROZEN, ROLES, AegisConfig, Calibration, ExportMode, Treatment
from aegis.delta import DeltaShield, PublicBatches
from aegis.exposure import IN_MEMORY, ExposurePolicy
from families import VOCAB, build

S = 50.0
FLOOD = Treatment("matrix", rho=1.0, snr=S)
PRESET = dict.fromkeys(ROLES, FROZEN) | {"mlp": FLOOD, "mlp_lora": FLOOD, "norm": FLOOD}


class PublicIds:
    """A public loss over fixed public token ids, one batch per call (as PublicBatches, without a tokenizer)."""

    def __init__(self, model, seed: int = 99, batches: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.model, self.batches, self.k = model, [torch.randint(3, VOCAB, (2, 7), generator=g) for _ in
                                                   range(batches)], 0

    def reset(self):
        self.k = 0

    def __call__(self):
        ids = self.batches[self.k % len(self.batches)]
        self.k += 1
        return self.model(input_ids=ids, labels=ids).loss


def private(seed: int, n: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, 9), generator=torch.Generator().manual_seed(seed))


def setup(seed=None, exposure=ExposurePolicy.OFF, lr=1e-2, **kw):
    model = build("llama")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    config = AegisConfig(preset=PRESET, export=ExportMode.DELTA, exposure=exposure, exposure_state=IN_MEMORY,
                         seed=seed, **kw)
    return model, opt, DeltaShield(model, opt, config, PublicIds(model))


def train(model, opt, batches, epochs=1):
    model.train()
    for _ in range(epochs):
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_one_flood_per_round_exactly_rho_clip_delta_plus_sigma_z(monkeypatch):
    calls = []
    real = delta_mod._flood
    monkeypatch.setattr(delta_mod, "_flood", lambda *a: (calls.append(a[1]), real(*a)))
    model, opt, shield = setup(seed=7)
    clean_model = copy.deepcopy(model)  # the same local training, unprotected
    clean_opt = torch.optim.AdamW([p for p in clean_model.parameters() if p.requires_grad], lr=1e-2)
    before = trainable(model)
    batches = [private(1), private(2), private(3)]
    with shield.round() as rnd:
        train(model, opt, batches)
    train(clean_model, clean_opt, batches)
    assert len(calls) == 1  # three local steps, one flood
    table = shield.public_params()
    names = list(table)
    assert set(rnd.delta) == set(names) and names
    clean = [(dict(clean_model.named_parameters())[n].detach() - before[n]).contiguous() for n in names]
    params = torch.tensor([table[n] for n in names], dtype=torch.float32)
    expected = [d.clone() for d in clean]
    ref.flood_many_(expected, ["matrix"] * len(names), params, ref.derive_key(ref.key_from_int(7), 0))
    for n, e in zip(names, expected):
        torch.testing.assert_close(rnd.delta[n], e, rtol=1e-5, atol=1e-7)
    # the model holds what the server holds: the snapshot plus the export
    for n, p in model.named_parameters():
        if n in rnd.delta:
            torch.testing.assert_close(p.detach(), before[n] + rnd.delta[n])


def test_private_data_does_not_move_the_public_table():
    tables = []
    for seed in (1, 2):
        model, opt, shield = setup()
        with shield.round():
            train(model, opt, [private(seed, n=2 + seed), private(seed + 10)])
        tables.append(shield.public_params())
    assert tables[0] == tables[1]
    rows = list(tables[0].values())
    assert all(math.isclose(rho * clip / sigma, S, rel_tol=1e-5) for rho, sigma, clip, _ in rows)
    # the table does follow the public round (what it is computed from): other public text, other sigma
    model, opt, shield = setup()
    shield._loss = PublicIds(model, seed=5)
    with shield.round():
        train(model, opt, [private(1, n=3), private(11)])
    assert shield.public_params() != tables[0]


def test_each_example_counts_once_per_round_and_a_second_round_is_refused():
    model, opt, shield = setup(exposure=ExposurePolicy.REFUSE)
    text = [private(1), private(2)]
    with shield.round():
        train(model, opt, text, epochs=3)  # three epochs over the same text: one exposure
    assert shield.report().max_exposure == 1
    after_first = trainable(model)
    with pytest.raises(RuntimeError, match="export\\(\\) refused: 2 example"):
        with shield.round():
            train(model, opt, text[:1])
    assert not shield.in_round and shield.report().rounds == 1
    assert all(torch.equal(p, after_first[n]) for n, p in trainable(model).items())  # the round was dropped
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    with shield.round() as rnd:
        train(model, opt, [private(3)])  # fresh text: exported
    assert rnd.delta and shield.report().rounds == 2


def test_silence_exports_pure_noise_past_the_budget():
    model, opt, shield = setup(exposure=ExposurePolicy.SILENCE)
    for _ in range(2):
        with shield.round():
            train(model, opt, [private(1)])
    report = shield.report()
    assert report.silenced_rounds == 1 and report.rounds == 2
    assert all(r.rho == 0.0 for r in report.flooded)


def test_an_aborted_round_counts_nothing_and_restores_the_snapshot():
    model, opt, shield = setup(exposure=ExposurePolicy.REFUSE)
    before = trainable(model)
    with pytest.raises(KeyError):
        with shield.round():
            train(model, opt, [private(1)])
            raise KeyError("the user's training failed")
    assert all(torch.equal(p, before[n]) for n, p in trainable(model).items())
    with shield.round() as rnd:  # the same text again: nothing was counted
        train(model, opt, [private(1)])
    assert rnd.delta


def test_local_steps_leave_nothing():
    model, opt, shield = setup()
    ids = private(1)
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="outside a round"):
        opt.step()
    with pytest.raises(RuntimeError, match="no round in progress"):
        shield.export()
    shield.begin_round()
    assert all(p.grad is None for p in model.parameters())  # gradients before the round are dropped
    with pytest.raises(RuntimeError, match="no optimizer step"):
        shield.export()
    reference = copy.deepcopy(model)
    model(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    # no per-step flood: the local gradients are the clean ones
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n
    opt.step()
    assert opt.state  # Adam moments of the round's private data, inside the round only
    with pytest.raises(RuntimeError, match="already in progress"):
        shield.begin_round()
    shield.export()
    assert not opt.state and all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="no round in progress"):
        shield.export()  # one export per round


def test_delta_noise_is_standard_normal_within_six_sigma():
    model, opt, shield = setup(seed=3)
    before = trainable(model)
    clean_model = copy.deepcopy(model)
    clean_opt = torch.optim.AdamW([p for p in clean_model.parameters() if p.requires_grad], lr=1e-2)
    with shield.round() as rnd:
        train(model, opt, [private(1), private(2)])
    train(clean_model, clean_opt, [private(1), private(2)])
    z = []
    for name, (rho, sigma, clip, _) in shield.public_params().items():
        d = dict(clean_model.named_parameters())[name].detach() - before[name]
        signal = rho * min(1.0, clip / float(d.norm())) * d
        z.append(((rnd.delta[name] - signal) / sigma).double().flatten())
    z_all = torch.cat(z)
    n = z_all.numel()
    assert n > 5000
    # mean of n standard normals: sd 1/sqrt(n); mean square: sd sqrt(2/n) (Var Z^2 = 2)
    assert abs(float(z_all.mean())) < 6 / math.sqrt(n)
    assert abs(float(z_all.square().mean()) - 1) < 6 * math.sqrt(2 / n)


def test_fresh_keys_give_different_noise_for_the_same_round():
    exports = []
    for _ in range(2):
        model, opt, shield = setup()
        with shield.round() as rnd:
            train(model, opt, [private(1)])
        exports.append(rnd.delta)
    assert exports[0].keys() == exports[1].keys()
    assert all(not torch.equal(exports[0][n], exports[1][n]) for n in exports[0])


def test_delta_params_meet_the_cap():
    stat = torch.tensor([0.5, 4.0])
    rho, sigma, clip, thr = delta_params(stat, "matrix", Treatment("matrix", rho=1.0, snr=10.0, clip=1.5), 0.01)
    assert float(clip) == 6.0 and math.isclose(float(sigma), 0.6, rel_tol=1e-6) and float(thr) == 0
    assert math.isclose(float(rho * clip / sigma), 10.0, rel_tol=1e-6)
    rho, sigma, _, _ = delta_params(stat, "matrix", Treatment("matrix", lam=2.0, rho=1.0), 0.01)
    assert float(rho) == 1.0 and float(sigma) == 1.0  # no cap: lam x mean |entry|
    rho, sigma, _, _ = delta_params(stat, "matrix", Treatment("matrix", lam=2.0, rho=1.0, snr=0.0), 0.01)
    assert float(rho) == 0.0 and float(sigma) == 1.0
    _, _, _, thr = delta_params(stat, "rows", Treatment("rows", rho=1.0, snr=10.0), 0.25)
    assert float(thr) == 1.0


def test_bad_input_names_the_fix():
    model = build("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = AegisConfig(preset=PRESET, export=ExportMode.DELTA, exposure=ExposurePolicy.OFF)
    loss = PublicIds(model)
    with pytest.raises(ValueError, match="export=ExportMode.DELTA"):
        DeltaShield(model, opt, config.replace(export=ExportMode.STEP), loss)
    with pytest.raises(ValueError, match="pass the local optimizer"):
        DeltaShield(model, None, config, loss)
    with pytest.raises(ValueError, match="calibration_loss=aegis.delta.PublicBatches"):
        DeltaShield(model, opt, config, None)
    with pytest.raises(ValueError, match="Calibration.BATCH"):
        DeltaShield(model, opt, config.replace(calibration=Calibration.BATCH), loss)
    with pytest.raises(ValueError, match="step-mode option"):
        DeltaShield(model, opt, config.replace(device_seed=True), loss)
    with pytest.raises(ValueError, match="export='sideways'"):
        AegisConfig(export="sideways")
    with pytest.raises(ValueError, match="no public text"):
        PublicBatches(model, None, ["", "  "], 2, 16)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        PublicBatches(model, None, ["public"], 0, 16)
    # a calibration loss that is not a scalar loss: refused, the round aborted and the snapshot restored
    shield = DeltaShield(model, opt, config, lambda: torch.ones(3))
    before = trainable(model)
    shield.begin_round()
    train(model, opt, [private(1)])
    with pytest.raises(ValueError, match="scalar loss"):
        shield.export()
    assert not shield.in_round
    assert all(torch.equal(p, before[n]) for n, p in trainable(model).items())


def test_public_batches_walk_the_texts_in_order():
    from aegis.models import default_decoder

    model, tok = default_decoder(arch="llama", n_layer=1)
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    batches = PublicBatches(model, tok, ["one two three.", "four five six seven.", "eight."], 2, 4)
    losses = [float(batches().detach()) for _ in range(3)]
    batches.reset()
    assert float(batches().detach()) == losses[0]  # reset: the same first batch, so the public round is reproducible
    assert losses[0] != losses[1]
    assert all(s[0] == 2 and s[1] <= 4 for s in seen)  # batch size and truncation
    handle.remove()


def test_the_report_states_the_round():
    model, opt, shield = setup()
    assert shield.report().noise_multiplier is None and shield.report().rounds == 0
    with shield.round():
        train(model, opt, [private(1), private(2)])
    report = shield.report()
    assert report.rounds == 1 and report.steps == 2 and report.export is ExportMode.DELTA
    assert all(math.isclose(r.snr, S, rel_tol=1e-5) for r in report.flooded)
    assert 0 < report.noise_multiplier < math.inf and report.privacy() is not None


def test_the_reconstruction_delta_preset_is_delta_mode_only():
    config = AegisConfig(preset="reconstruction-delta")
    assert config.export is ExportMode.DELTA and config.promise is not None and config.promise.min_batch == 8
    assert config.treatments["attention_lora"] == FROZEN and config.treatments["token_embedding"] == FROZEN
    assert config.treatments["mlp_lora"].snr == config.treatments["mlp"].snr == 300.0
    assert AegisConfig(preset="reconstruction-delta", export=ExportMode.STEP).export is ExportMode.DELTA
    assert AegisConfig(preset="sentences", export=ExportMode.DELTA).promise is None  # measured per step only
