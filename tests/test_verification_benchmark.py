"""benchmarks/verification.py: its candidate sets, settings and pooled statistics (the measurement itself
is a benchmark run: see the module docstring)."""
import math

import pytest
from scipy.stats import binom

import benchmark_scripts
from aegis.data import load_corpus


@pytest.fixture(scope="module")
def bench():
    return benchmark_scripts.load("verification")


def test_candidate_sets_of_any_size(bench):
    corpus = load_corpus("train")
    pool, filler = corpus[:160], corpus[200:]
    big = bench.tasks(8, 1000, pool, filler)
    secrets, sentences = big["secret"], big["sentence"]
    assert len(secrets) == len(sentences) == 1000
    assert len({c.texts[0] for c in secrets}) == 1000 and all(len(c.texts) == 8 for c in secrets)
    assert len({frozenset(c.texts) for c in sentences}) == 1000 and all(len(c.texts) == 8 for c in sentences)
    assert set(bench.tasks(1, 1000, pool, filler)) == {"secret"}  # 160 sentences cannot make 1000 batches
    small = bench.tasks(4, 40, pool, filler)["sentence"]  # disjoint chunks while the pool lasts
    assert len({t for c in small for t in c.texts}) == 160


def test_settings_cover_presets_budgets_and_leaky_controls(bench):
    chosen = bench.settings()
    assert {p.value for p in bench.PRESETS} == {"verification", "sentences"}  # ``paper`` promises nothing
    for preset in bench.PRESETS:
        budget = preset.promise.exposures
        assert chosen[f"{preset.value} K=1"][1] == 1 and chosen[f"{preset.value} K=1"][0].preset is preset
        assert chosen[f"past budget: {preset.value} K={16 * budget}"][1] == 16 * budget
    bare = chosen["no noise: rho 1 lam 0"][0].treatments["token_embedding"]
    assert (bare.lam, bare.rho, bare.clip) == (0.0, 1.0, math.inf)


def test_pooled_statistics_per_n(bench):
    rows = [dict(setting="s", variant=v, candidates=n, accuracy=acc, trials=40, null=1 / n)
            for v in bench.VARIANTS for n, acc in ((10, 0.1), (1000, 0.05))]
    pooled = {(p["candidates"], p["variant"]): p for p in bench.pooled(rows)}
    p = pooled[(1000, "likelihood")]
    assert p["null"] == 0.001 and p["bar"] == pytest.approx(0.051) and p["trials"] == 40
    assert p["p_value"] == pytest.approx(binom.sf(1, 40, 0.001))  # P(>= 2 hits of 40 by chance)
    assert pooled[(10, "level")]["p_value"] == pytest.approx(binom.sf(3, 40, 0.1))
