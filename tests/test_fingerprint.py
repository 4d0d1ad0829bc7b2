"""Flood-level fingerprinting (aegis.attacks.fingerprint): under the paper's batch calibration the server
picks the client's batch among N candidates from the per-tensor noise levels; under the public
calibration the level attack is at chance by construction.

Most tests swap the flood's ChaCha normals for a keyed ``torch.randn`` (``fast_noise``, tests/fast_noise.py):
the CPU reference cipher takes seconds per masked step of the decoder, and the attacks never read the noise,
only its law (they do not know the key). Calibration, clipping, masking and export all run through the real shield.
The slow tests also run the real cipher end to end.
"""
import math

import pytest
import torch

import aegis
import aegis_kernels.reference as ref
from aegis.attacks import fingerprint_accuracy, identify_sentence, secret_completion, shared_gradient, verify
from aegis.attacks.fingerprint import (
    VARIANTS,
    FingerprintAttack,
    fingerprint_accuracies,
    fingerprint_null,
    flood_levels,
    lm_batch,
    predicted_levels,
    rank_of_truth,
    top_share,
)
from aegis.config import AegisConfig, Calibration, Treatment
from aegis.data import LABELS, load_corpus
from aegis.models import default_decoder, default_encoder
from fast_noise import CHACHA_COMPONENTS, fast_noise  # noqa: F401  (fixture)

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")  # fixed keys: tests only

BATCH, PUBLIC = Calibration.BATCH, Calibration.PUBLIC
TEMPLATE = "my pin is {}"
VALUES = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(40)]  # 40 distinct 4-digit pins
SECRETS = [[TEMPLATE.format(v)] for v in VALUES]
POOL = [e.text for e in load_corpus("validation")[:24]]
SENTENCES = [[t] for t in POOL]



@pytest.fixture(scope="module")
def decoder():
    return default_decoder(arch="gpt2", n_layer=1)


def config(calibration, seed=0, **kw):
    return AegisConfig(calibration=calibration, seed=seed, **kw)


# -- pieces ------------------------------------------------------------------------------------------------


def test_flood_levels_read_the_noise_through_signal_rows():
    gen = torch.Generator().manual_seed(0)
    sigma = 0.02
    rows = sigma * torch.randn(4000, 256, generator=gen)
    rows[:12] += 3.0 * torch.randn(12, 256, generator=gen)  # a few signal rows, far above the noise
    matrix = sigma * torch.randn(300, 200, generator=gen)
    levels = flood_levels({"rows": rows, "matrix": matrix, "bias": sigma * torch.randn(384, generator=gen),
                           "closed": torch.zeros(10, 10), "nan": torch.full((5,), math.nan)})
    assert levels["rows"] == pytest.approx(sigma, rel=3 / math.sqrt(2 * rows.numel()))
    assert levels["matrix"] == pytest.approx(sigma, rel=3 / math.sqrt(2 * matrix.numel()))
    assert levels["bias"] == pytest.approx(sigma, rel=0.15)
    assert levels["closed"] == 0.0 and levels["nan"] == 0.0
    # plain RMS would be ruined by the signal rows; the robust level is not
    assert rows.pow(2).mean().sqrt() > 5 * sigma


def test_ranks_and_ties():
    assert rank_of_truth([3.0, 1.0, 2.0], 2) == 2.0 and top_share([3.0, 1.0, 2.0], 1) == 1.0
    assert rank_of_truth([1.0, 1.0, 1.0, 1.0], 0) == 2.5  # all tied: the expected rank of a random pick
    assert top_share([1.0, 1.0, 1.0, 1.0], 3) == 0.25 and top_share([1.0, 0.5], 0) == 0.0
    assert fingerprint_null(40) == 0.025


def test_predicted_levels_are_the_shields(decoder, fast_noise):
    """BATCH: the truth's predicted sigma is what the shield used (read back to ~1/sqrt(2n)); another
    candidate's differs. PUBLIC: the prediction is the same for every candidate."""
    model, tok = decoder
    truth, other = SECRETS[0], SECRETS[1]
    for calibration in (BATCH, PUBLIC):
        cfg = config(calibration)
        exported = shared_gradient(model, truth, tok, shield=aegis.protect(model, config=cfg))
        observed = flood_levels(exported)
        mine = predicted_levels(model, lm_batch(tok, truth, model), cfg)
        theirs = predicted_levels(model, lm_batch(tok, other, model), cfg)
        assert set(mine) == set(exported)
        big = [n for n in mine if exported[n].numel() >= 100_000]
        assert len(big) >= 3
        for name in big:
            assert observed[name] == pytest.approx(mine[name], rel=4 / math.sqrt(2 * exported[name].numel())), name
        if calibration is PUBLIC:
            assert mine == theirs
        else:
            gaps = [abs(math.log(mine[n] / theirs[n])) * math.sqrt(2 * exported[n].numel()) for n in big]
            assert max(gaps) > 10  # many standard errors apart: the fingerprint


# -- the attack against the paper's batch calibration ------------------------------------------------------


def test_batch_calibration_secret_completion(decoder, fast_noise):
    model, tok = decoder
    cfg = config(BATCH, seed=1)
    exported = shared_gradient(model, SECRETS[7], tok, shield=aegis.protect(model, config=cfg))
    guess = secret_completion(model, tok, exported, TEMPLATE, VALUES[:10], cfg)
    assert guess.choice == VALUES[7] and guess.index == 7 and len(guess.scores) == 10
    result = fingerprint_accuracy(model, tok, cfg, SECRETS, [0, 17, 26, 39])
    print(f"BATCH secret completion N=40: {result.accuracy:.2f} (null {result.null:.3f}), ranks {result.ranks}")
    assert result.accuracy >= 0.9


def test_batch_calibration_sentence_identification(decoder, fast_noise):
    model, tok = decoder
    cfg = config(BATCH, seed=2)
    exported = shared_gradient(model, SENTENCES[5], tok, shield=aegis.protect(model, config=cfg))
    assert identify_sentence(model, tok, exported, POOL[:8], cfg).choice == POOL[5]
    scores = verify(model, exported, SENTENCES[:8], cfg, lambda texts: lm_batch(tok, texts, model), variant="energy")
    assert rank_of_truth(scores, 5) == 1.0
    result = fingerprint_accuracy(model, tok, cfg, SENTENCES, [0, 11, 18, 23])
    print(f"BATCH sentence identification N={len(SENTENCES)}: {result.accuracy:.2f}, ranks {result.ranks}")
    assert result.accuracy >= 0.9


def test_batch_calibration_at_lam_50_still_fingerprints(decoder, fast_noise):
    """The level is read relative to the candidates' predictions: 50x the noise changes nothing."""
    model, tok = decoder
    strong = {role: Treatment(t.kind, lam=50.0, rho=t.rho, clip=t.clip)
              for role, t in AegisConfig().treatments.items() if t.kind != "frozen"}
    cfg = config(BATCH, seed=3, overrides=strong)
    result = fingerprint_accuracy(model, tok, cfg, SECRETS, [4, 26, 35])
    print(f"BATCH lam 50 secret completion: {result.accuracy:.2f}, ranks {result.ranks}")
    assert result.accuracy >= 0.9


# -- the public calibration --------------------------------------------------------------------------------

PUBLIC_TRIALS = list(range(1, 40, 5)) + list(range(3, 40, 5))  # 16 trials: > 1 hit fails (P = 0.06 by chance)


@pytest.fixture(scope="module")
def public_results(decoder, fast_noise):
    model, tok = decoder
    return fingerprint_accuracies(model, tok, config(PUBLIC, seed=4), SECRETS, PUBLIC_TRIALS, variants=VARIANTS)


def test_public_calibration_level_attack_is_at_chance(public_results):
    """The predicted levels do not depend on the candidate: every candidate ties, accuracy = 1/N exactly."""
    level = public_results["level"]
    assert level.accuracy == pytest.approx(1 / 40)
    assert level.ranks == [20.5] * len(PUBLIC_TRIALS)


def test_public_calibration_energy_attack_is_at_chance(public_results):
    """Observed mean square against rho^2 ||clip(G)||^2 + sigma^2 n: the clipped signal's energy is far
    below the precision of the read (embedding: ~1e-7 of the noise energy, read to ~4e-4), so the ranks are
    spread like a random guess's."""
    energy = public_results["energy"]
    print(f"PUBLIC energy: {energy.accuracy:.3f} (null 0.025), mean rank {energy.mean_rank:.1f} of 40, {energy.ranks}")
    assert energy.accuracy <= 1 / 40 + 0.05
    assert energy.mean_rank >= 12  # chance: 20.5 +- 2.9 over 16 trials; a leak pulls it towards 1


def test_public_calibration_likelihood_attack_is_at_chance(public_results):
    """The matched filter <out, rho clip(G_candidate)>: the paper preset's rows rho keeps each token row's
    rho * clip / sigma (``ReportRow.snr``) far below 1."""
    likelihood = public_results["likelihood"]
    print(f"PUBLIC likelihood: {likelihood.accuracy:.3f}, mean rank {likelihood.mean_rank:.1f}")
    assert likelihood.accuracy <= 1 / 40 + 0.05
    assert likelihood.mean_rank >= 12


def test_likelihood_reads_the_paper_original_rows_rho(decoder, fast_noise):
    """Weakened: the paper's original rows rho = 0.3 keeps rho * clip / sigma ~ 3 per token row (1-layer
    decoder); the matched filter then picks the PIN among 40 every time."""
    model, tok = decoder
    weak = Treatment("rows", lam=1.0, rho=0.3)
    cfg = config(PUBLIC, seed=5, overrides={r: weak for r in ("token_embedding", "position_embedding", "lm_head")})
    result = fingerprint_accuracy(model, tok, cfg, SECRETS, PUBLIC_TRIALS[:8], variant="likelihood")
    assert result.accuracy >= 0.9


def test_variant_is_checked(decoder):
    model, tok = decoder
    with pytest.raises(ValueError, match="variant"):
        fingerprint_accuracy(model, tok, config(BATCH), SECRETS[:2], [0], variant="nope")
    with pytest.raises(ValueError, match="at least 2"):
        fingerprint_accuracy(model, tok, config(BATCH), SECRETS[:1], [0])


# -- slow: B = 4, more trials, other families, the real cipher -----------------------------------------------


@pytest.mark.slow
def test_b4_batch_identification(decoder, fast_noise):
    model, tok = decoder
    examples = load_corpus("validation")
    batches = [[e.text for e in examples[4 * i : 4 * i + 4]] for i in range(20)]
    trials = list(range(0, 20, 2))
    batch = fingerprint_accuracies(model, tok, config(BATCH, seed=5), batches, trials)
    public = fingerprint_accuracies(model, tok, config(PUBLIC, seed=6), batches, trials)
    for name, results in (("BATCH", batch), ("PUBLIC", public)):
        for v, r in results.items():
            print(f"B=4 {name} {v}: {r.accuracy:.2f} (null {r.null:.3f}), mean rank {r.mean_rank:.1f}")
    assert all(r.accuracy >= 0.9 for r in batch.values())
    assert public["level"].accuracy == pytest.approx(1 / 20)
    assert public["energy"].accuracy <= 1 / 20 + 0.05


@pytest.mark.slow
def test_public_energy_over_40_trials(decoder, fast_noise):
    model, tok = decoder
    result = fingerprint_accuracies(model, tok, config(PUBLIC, seed=7), SECRETS, list(range(40)),
                                    variants=("level", "energy"))
    for v, r in result.items():
        print(f"PUBLIC {v} 40 trials: {r.accuracy:.3f}, mean rank {r.mean_rank:.1f}")
    assert result["level"].accuracy == pytest.approx(1 / 40)
    assert result["energy"].accuracy <= 1 / 40 + 0.05 and result["energy"].mean_rank >= 14


@pytest.mark.slow
def test_rope_llama(fast_noise):
    model, tok = default_decoder(arch="llama", n_layer=1)
    for calibration, seed in ((BATCH, 8), (PUBLIC, 9)):
        for name, cands, trials in (("secret", SECRETS, [3, 19, 33]), ("pool", SENTENCES, [2, 14, 21])):
            results = fingerprint_accuracies(model, tok, config(calibration, seed=seed), cands, trials)
            for v, r in results.items():
                print(f"llama {calibration.value} {name} {v}: {r.accuracy:.2f}, mean rank {r.mean_rank:.1f}")
            if calibration is BATCH:
                assert results["level"].accuracy >= 0.9
            else:
                assert results["level"].accuracy == pytest.approx(1 / len(cands))


@pytest.mark.slow
def test_encoder_with_unknown_labels(fast_noise):
    """BERT classifier: the attacker tries every label of each pool sentence and keeps the best."""
    model, tok = default_encoder(num_labels=len(LABELS))
    examples = load_corpus("validation")[:20]
    pool = [e.text for e in examples]
    cfg = config(BATCH, seed=10)
    shield = aegis.protect(model, config=cfg)
    hits = 0
    for i in (1, 7, 13):
        exported = shared_gradient(model, [pool[i]], tok, shield=shield, labels=[LABELS.index(examples[i].label)])
        hits += identify_sentence(model, tok, exported, pool, cfg).index == i
    assert hits == 3


@pytest.mark.slow
def test_real_cipher_end_to_end(decoder, monkeypatch):
    """No noise swap: the shield's ChaCha floods (fresh secret key per step: seed=None)."""
    monkeypatch.setattr(ref, "noise_components", CHACHA_COMPONENTS)  # undo fast_noise if an earlier test set it up
    model, tok = decoder
    cfg = AegisConfig(calibration=BATCH)
    exported = shared_gradient(model, SECRETS[11], tok, shield=aegis.protect(model, config=cfg))
    assert secret_completion(model, tok, exported, TEMPLATE, VALUES, cfg).choice == VALUES[11]
    cfg = AegisConfig(calibration=PUBLIC)
    exported = shared_gradient(model, SECRETS[23], tok, shield=aegis.protect(model, config=cfg))
    level = secret_completion(model, tok, exported, TEMPLATE, VALUES, cfg)
    assert len(set(level.scores)) == 1  # all candidates tie
    attack = FingerprintAttack(model, cfg)
    obs = attack.observe(exported)
    scores = [attack.score(obs, attack.predict(lm_batch(tok, c, model), True), "likelihood") for c in SECRETS]
    print(f"real cipher, PUBLIC likelihood: rank of truth {rank_of_truth(scores, 23)}")
