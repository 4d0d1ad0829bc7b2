"""1-of-N candidate verification at any N (aegis.attacks.candidates, aegis.attacks.per_example).

Per-example gradients from one batched pass must equal one pass per candidate; the chunked scores must
equal ``fingerprint``'s per-candidate scores up to a constant shared by all candidates; the attack must
find the client's batch where the defence lets it (batch calibration, rows rho 0.3 without an snr cap,
K exports averaged) and stay at chance under the paper preset. Noise: keyed torch.randn (``fast_noise``).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import aegis
from aegis.attacks import shared_gradient
from aegis.attacks.candidates import Candidate, Verifier, score_accuracy, secret_candidates, verification_accuracy
from aegis.attacks.fingerprint import FingerprintAttack, lm_batch
from aegis.attacks.per_example import per_example_gradients, supported
from aegis.attacks.repeated import averaged_export, joint_scores
from aegis.config import AegisConfig, Calibration, ExposurePolicy, Treatment
from aegis.data import load_corpus
from aegis.models import default_decoder
from fast_noise import fast_noise  # noqa: F401  (fixture)

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")

PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(100)]
ROWS = ("token_embedding", "position_embedding", "lm_head")


@pytest.fixture(scope="module")
def gpt2():
    return default_decoder(arch="gpt2", n_layer=1)


def _per_candidate(model, tok, texts, params):
    """The candidate's gradient from its own pass, the causal-LM loss in the model's dtype (the model's own
    loss casts logits to float32)."""
    batch = lm_batch(tok, texts, model)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def test_per_example_gradients_equal_one_pass_each(gpt2):
    """Every trainable tensor of a GPT-2 block (embeddings, tied head, Conv1D, LayerNorm, biases), with
    candidates of two texts of unequal length (padding inside and across candidates). In float64 on a copy,
    so the comparison is exact to rounding: the batched pass and the per-candidate passes sum in different
    orders, which float32 resolves only to about 1e-6 of a tensor's largest entry."""
    model, tok = copy.deepcopy(gpt2[0]).double(), gpt2[1]
    corpus = [e.text for e in load_corpus("validation")]
    cands = [corpus[2 * i : 2 * i + 2] for i in range(3)]
    params = [p for p in model.parameters() if p.requires_grad]
    assert supported(model, params)
    enc = lm_batch(tok, [t for c in cands for t in c], model)
    got = per_example_gradients(model, params, enc["input_ids"], enc["attention_mask"], enc["labels"], 3,
                                decoder=True)
    for i, c in enumerate(cands):
        for g, want in zip(got, _per_candidate(model, tok, c, params)):
            assert g.dtype == torch.float64
            assert torch.allclose(g[i], want, rtol=1e-9, atol=1e-12 * want.abs().max().clamp_min(1e-30))
    assert all(p.grad is None for p in params)  # nothing accumulated into the model


def test_unsupported_parameters_are_named():
    model, _ = default_decoder(arch="llama", n_layer=1)
    norm = [p for n, p in model.named_parameters() if "layernorm" in n]
    assert norm and not supported(model, norm)
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="one example at a time"):
        per_example_gradients(model, norm, ids, ids, ids, 1, decoder=True)


@pytest.mark.parametrize("calibration", [Calibration.BATCH, Calibration.PUBLIC])
def test_scores_match_the_fingerprint_attack(gpt2, fast_noise, calibration):
    """Same export, 6 candidates: chunked (2 per pass) and one-pass-per-candidate scores differ from
    FingerprintAttack.score by one constant per variant."""
    model, tok = gpt2
    cfg = AegisConfig(calibration=calibration, seed=11)
    cands = secret_candidates("my pin is {}", PINS[:6])
    exported = shared_gradient(model, list(cands[2].texts), tok, shield=aegis.protect(model, config=cfg))
    attack = FingerprintAttack(model, cfg)
    obs = attack.observe(exported)
    verifier = Verifier(model, tok, cfg, chunk=2)
    scores = verifier.scores([verifier.observe(exported)], cands)
    verifier.batched = False
    slow = verifier.scores([verifier.observe(exported)], cands)
    for variant, s in scores.items():
        want = torch.tensor([attack.score(obs, attack.predict(lm_batch(tok, list(c.texts), model), True), variant)
                             for c in cands], dtype=torch.float64)
        for got in (s[0], slow[variant][0]):
            diff = (got - got[0]) - (want - want[0])
            assert diff.abs().max() <= 1e-4 * (want - want[0]).abs().max() + 1e-6, variant


def _leaky_settings():
    weak = Treatment("rows", lam=1.0, rho=0.3)
    return ((AegisConfig(calibration=Calibration.BATCH, seed=12), ("level", "likelihood")),
            (AegisConfig(seed=13, overrides={r: weak for r in ROWS}), ("likelihood",)))


def _picks(model, tok, cfg, cands, truths, variants):
    shield = aegis.protect(model, config=cfg)
    verifier = Verifier(model, tok, cfg)
    obs = [verifier.observe(shared_gradient(model, list(cands[t].texts), tok, shield=shield)) for t in truths]
    return verification_accuracy(verifier, obs, truths, cands, variants)


def test_batch_calibration_and_weak_rows_pick_the_pin(gpt2, fast_noise):
    model, tok = gpt2
    cands = secret_candidates("my pin is {}", PINS[:20])
    for cfg, variants in _leaky_settings():
        results = _picks(model, tok, cfg, cands, [13], variants)
        assert all(r.accuracy == 1.0 and r.null == 0.05 for r in results.values()), results


@pytest.mark.slow
def test_batch_calibration_and_weak_rows_pick_the_pin_among_100(gpt2, fast_noise):
    model, tok = gpt2
    cands = secret_candidates("my pin is {}", PINS)
    for cfg, variants in _leaky_settings():
        results = _picks(model, tok, cfg, cands, [7, 64, 99], variants)
        assert all(r.accuracy == 1.0 and r.null == 0.01 for r in results.values()), results


def test_paper_preset_stays_at_chance(gpt2, fast_noise):
    """4 trials of 1-of-40: a chance-level attacker scores >= 2 hits with P = 0.4 %; the level variant
    ties every candidate (exactly 1/40)."""
    model, tok = gpt2
    config = AegisConfig(preset="verification", seed=14, allow_outside_promise=True)
    results = _picks(model, tok, config, secret_candidates("my pin is {}", PINS[:40]), [2, 13, 24, 35],
                     ("level", "energy", "likelihood"))
    assert results["level"].accuracy == pytest.approx(1 / 40)
    for v in ("energy", "likelihood"):
        assert results[v].accuracy * 4 <= 1 + 1e-9, (v, results[v].ranks)


def test_k_exports_scored_as_their_mean(gpt2, fast_noise):
    """Batch calibration, the mean of K = 4 exports: the level of the mean is sigma / 2, and a verifier
    told K = 4 reads it (one told K = 1 compares it with sigma and misses by 2n ln(2)^2 per tensor)."""
    model, tok = gpt2
    cfg = AegisConfig(calibration=Calibration.BATCH, seed=15)
    cands = secret_candidates("my pin is {}", PINS[:10])
    shield = aegis.protect(model, config=cfg)
    mean = averaged_export(lambda: shared_gradient(model, list(cands[3].texts), tok, shield=shield), 4)
    right = Verifier(model, tok, cfg, exposures=4)
    result = verification_accuracy(right, [right.observe(mean)], [3], cands, ("level",))["level"]
    assert result.accuracy == 1.0
    wrong = Verifier(model, tok, cfg)
    assert wrong.scores([wrong.observe(mean)], cands, ("level",))["level"].min() > \
        right.scores([right.observe(mean)], cands, ("level",))["level"].min() + 1e3


def _rounds(model, tok, cfg, cands, truths, count, drift=0.0):
    """One export of each truth per round under one shield (fresh step keys); between rounds the MLP
    moves by ``drift`` (seeded), as other clients' updates move a federated model. -> [(verifier, obs)]"""
    gen = torch.Generator().manual_seed(0)
    shield = aegis.protect(model, config=cfg)
    out = []
    for _ in range(count):
        verifier = Verifier(model, tok, cfg)  # the server knows the model of every round it sent
        out.append((verifier, [verifier.observe(shared_gradient(model, list(cands[t].texts), tok, shield=shield))
                               for t in truths]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp." in name:
                    p.add_(drift * torch.randn(p.shape, generator=gen))
    shield.remove()
    return out


def test_rounds_at_one_model_rank_as_their_mean(gpt2, fast_noise):
    """Summed per-round log-likelihoods of three exports differ between candidates exactly as the
    likelihood of their mean does (read with sigma / sqrt 3)."""
    model, tok = gpt2
    weak = Treatment("rows", lam=1.0, rho=0.3, snr=0.5)
    cfg = AegisConfig(seed=17, exposure=ExposurePolicy.OFF, overrides={r: weak for r in ROWS})
    cands = secret_candidates("my pin is {}", PINS[:8])
    shield = aegis.protect(model, config=cfg)
    exports = [shared_gradient(model, list(cands[5].texts), tok, shield=shield) for _ in range(3)]
    shield.remove()
    one = Verifier(model, tok, cfg)
    joint = joint_scores([(one, [one.observe(e)]) for e in exports], cands, ("likelihood",))["likelihood"]
    replay = iter(exports)
    mean = averaged_export(lambda: next(replay), 3)
    k3 = Verifier(model, tok, cfg, exposures=3)
    averaged = k3.scores([k3.observe(mean)], cands, ("likelihood",))["likelihood"]
    assert torch.allclose(joint - joint[:, :1], averaged - averaged[:, :1], rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="one export"):
        joint_scores([(k3, [k3.observe(mean)])], cands)


def test_rounds_of_a_moving_model_add_up(gpt2, fast_noise):
    """Rows snr 0.5, the MLP drifting between rounds: one round misses the PIN, four rounds (each scored
    at its own model) find it every time; the exposure budget is what stops this (exposure OFF here)."""
    model, tok = gpt2
    weak = Treatment("rows", lam=1.0, rho=0.3, snr=0.5)
    cfg = AegisConfig(seed=21, exposure=ExposurePolicy.OFF, overrides={r: weak for r in ROWS})
    cands, truths = secret_candidates("my pin is {}", PINS[:20]), [3, 13, 17]
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        rounds = _rounds(model, tok, cfg, cands, truths, 4, drift=1e-3)
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
    one = score_accuracy(joint_scores(rounds[:1], cands, ("likelihood",)), truths)["likelihood"]
    four = score_accuracy(joint_scores(rounds, cands, ("likelihood",)), truths)["likelihood"]
    assert one.accuracy < 1.0 and four.accuracy == 1.0, (one.ranks, four.ranks)
    with pytest.raises(ValueError, match="same trials"):
        joint_scores([rounds[0], (rounds[1][0], rounds[1][1][:1])], cands)


def test_bad_input_is_named(gpt2):
    model, tok = gpt2
    cfg = AegisConfig(seed=16)
    with pytest.raises(ValueError, match="exposures"):
        Verifier(model, tok, cfg, exposures=0)
    with pytest.raises(ValueError, match="chunk"):
        Verifier(model, tok, cfg, chunk=0)
    with pytest.raises(ValueError, match="at least one text"):
        Candidate(())
    with pytest.raises(ValueError, match="one per text"):
        Candidate(("a", "b"), (1,))
    with pytest.raises(ValueError, match="template"):
        secret_candidates("my pin", PINS[:3])
    verifier = Verifier(model, tok, cfg)
    with pytest.raises(ValueError, match="variant"):
        verifier.scores([], secret_candidates("my pin is {}", PINS[:3]), ("nope",))
    with pytest.raises(ValueError, match="at least 2"):
        verification_accuracy(verifier, [], [], secret_candidates("my pin is {}", PINS[:1]))


def test_nothing_candidate_dependent_ties_and_no_noise_is_least_squares(gpt2, fast_noise):
    """rho 0 everywhere: no tensor depends on the candidate, every score ties (exactly 1/N); lam 0 with
    rho 0.3: no noise at all, the truth's residual is ~0 and it wins."""
    model, tok = gpt2
    cands = secret_candidates("my pin is {}", PINS[:8])
    silent = AegisConfig(seed=17, overrides={r: Treatment("rows", lam=1.0, rho=0.0) for r in ROWS})
    verifier = Verifier(model, tok, silent)
    assert verifier.tensors == []
    assert verification_accuracy(verifier, [verifier.observe({})], [5], cands)["likelihood"].accuracy == 1 / 8
    bare = AegisConfig(seed=18, overrides={r: Treatment("rows", lam=0.0, rho=0.3) for r in ROWS})
    result = _picks(model, tok, bare, cands, [5], ("likelihood",))["likelihood"]
    assert result.accuracy == 1.0
