"""(epsilon, delta) where users read it: Shield.report()'s noise multiplier and statement, the Aegis defence's
report (the audit's and the utility page's DP epsilon column), checked against independent computations:
the preset's snr cap in closed form, scipy's normal CDF for the analytic Gaussian mechanism, Opacus's PRV."""
from __future__ import annotations

import builtins
import math

import pytest
import torch
import transformers
from scipy.stats import norm

from aegis import AegisConfig, Calibration, ExposurePolicy, Preset, protect
from aegis.accounting import PRV_LIMIT, epsilons, gaussian_epsilon, statement
from aegis.config import VERIFICATION_EXPOSURES, VERIFICATION_ROWS_SNR
from aegis.defence import Aegis


def tiny_gpt2(vocab=200, positions=64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=vocab, n_positions=positions)
    return transformers.GPT2LMHeadModel(cfg)


def analytic_delta(eps: float, mu: float) -> float:
    """delta(eps) of the Gaussian mechanism with sensitivity / noise mu (Balle and Wang 2018), via scipy."""
    return math.exp(norm.logcdf(-eps / mu + mu / 2)) - math.exp(eps + norm.logcdf(-eps / mu - mu / 2))


def test_report_states_the_verification_presets_epsilon_from_its_cap():
    shield = protect(tiny_gpt2(), None, AegisConfig(preset=Preset.VERIFICATION))
    assert shield.report().noise_multiplier is None and shield.report().privacy() is None  # not calibrated yet
    shield.calibrate()
    report = shield.report()
    rows = [r for r in report.rows if r.action == "rows flood"]
    assert {r.name for r in rows} == {"transformer.wte.weight", "transformer.wpe.weight"}  # the head is tied
    assert all(r.snr == pytest.approx(VERIFICATION_ROWS_SNR) for r in rows)  # the cap binds on every row
    assert all(r.rho == 0.0 for r in report.flooded if r.action == "matrix flood")  # pure noise: no signal
    # each of R rows moves by at most 2 x snr noise units: z = 1 / (2 snr sqrt(sum R)), R = 200 + 64 rows
    z = 1 / (2 * VERIFICATION_ROWS_SNR * math.sqrt(200 + 64))
    assert report.noise_multiplier == pytest.approx(z, rel=1e-6)
    privacy = report.privacy()
    assert privacy.compositions == VERIFICATION_EXPOSURES and privacy.sample_rate == 1.0 and privacy.delta == 1e-5
    mu = math.sqrt(VERIFICATION_EXPOSURES) / z  # K Gaussian mechanisms compose to one of parameter sqrt(K) mu
    assert privacy.method == "exact" and 1.0 < privacy.epsilon < 20.0
    assert analytic_delta(privacy.epsilon, mu) == pytest.approx(1e-5, rel=1e-6)
    assert analytic_delta(0.99 * privacy.epsilon, mu) > 1e-5  # the smallest such epsilon
    from opacus.accountants import PRVAccountant  # an independent accountant: its grid error is 0.01 or so

    prv = PRVAccountant()
    prv.history = [(z, 1.0, VERIFICATION_EXPOSURES)]
    assert abs(prv.get_epsilon(1e-5) - privacy.epsilon) <= 0.02 * privacy.epsilon
    assert privacy.epsilon <= privacy.epsilon_rdp and "per example" in privacy.line()


def test_no_finite_epsilon_for_clean_exports_none_under_batch_calibration_zero_when_nothing_leaves():
    names = [n for n, _ in tiny_gpt2().named_parameters()]
    clean = protect(tiny_gpt2(), None, AegisConfig(allow_clean=tuple(n for n in names if "ln_f" in n)))
    clean.calibrate()
    assert clean.report().noise_multiplier == 0.0 and clean.report().privacy().epsilon == math.inf
    batch = protect(tiny_gpt2(), None, AegisConfig(calibration=Calibration.BATCH))
    assert batch.report().noise_multiplier is None and batch.report().privacy() is None
    # `sentences` freezes every vocabulary-indexed tensor; its MLP and norms carry signal at snr 1000 per tensor
    sentences = protect(tiny_gpt2(), None, AegisConfig(preset=Preset.SENTENCES))
    sentences.calibrate()
    report = sentences.report()
    signal = [r for r in report.flooded if r.rho]
    assert report.noise_multiplier == pytest.approx(1 / math.sqrt(sum((2 * r.snr) ** 2 for r in signal)), rel=1e-6)
    assert report.privacy().epsilon > 1e3  # one export at snr 1000 is no DP guarantee worth the name


def test_the_aegis_defence_reports_epsilon_for_the_audit_and_the_utility_page():
    model = tiny_gpt2()
    defence = Aegis(AegisConfig(preset=Preset.VERIFICATION))
    defence.attach(model)
    batch = {"input_ids": torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(1))}
    batch["labels"] = batch["input_ids"]
    model(**batch).loss.backward()
    defence.defend_()
    out = defence.report()
    expected = defence.shield.report().privacy()
    assert out["epsilon"] == expected.epsilon and out["delta"] == 1e-5
    assert out["compositions"] == VERIFICATION_EXPOSURES and out["noise_multiplier"] == expected.noise_multiplier
    off = Aegis(AegisConfig(preset=Preset.VERIFICATION, exposure=ExposurePolicy.OFF))
    off.attach(tiny_gpt2())
    off.shield.calibrate()
    assert off.report()["epsilon"] == math.inf  # nothing bounds the exports
    defence.detach()
    off.detach()


def test_sampled_statements_never_exceed_the_unsampled_exact_one_and_skip_prv_where_it_would_not_fit():
    z, k = 2e-4, 3  # epsilon ~ 1e4: the RDP bound is looser than the exact unsampled composition
    eps, rdp, method = epsilons(z, k, 0.5, 1e-5)
    assert rdp > PRV_LIMIT and method == "unsampled" and eps == gaussian_epsilon(math.sqrt(k) / z, 1e-5) < rdp
    eps, rdp, method = epsilons(0.2, 50, 0.05, 1e-5)  # RDP above the limit: its bound stands, no PRV grid
    assert rdp > PRV_LIMIT and method == "rdp" and eps == rdp < gaussian_epsilon(math.sqrt(50) / 0.2, 1e-5)
    eps, rdp, method = epsilons(1.0, 10, 0.1, 1e-5)  # affordable: PRV, tighter than RDP
    assert method == "prv" and 0 < eps <= rdp <= PRV_LIMIT


def test_without_opacus_the_exact_statement_stands_and_sampling_asks_for_it(monkeypatch):
    real = builtins.__import__

    def no_opacus(name, *args, **kwargs):
        if name.startswith("opacus"):
            raise ImportError("no opacus here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_opacus)
    s = statement(1.5, 4)
    assert s.method == "exact" and s.epsilon == gaussian_epsilon(math.sqrt(4) / 1.5, 1e-5) and math.isnan(s.epsilon_rdp)
    assert "RDP" not in s.line()
    with pytest.raises(ImportError, match="pip install opacus"):
        statement(1.5, 4, sample_rate=0.5)
