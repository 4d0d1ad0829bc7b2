"""The audit's data: read and check the dataset before any model loads, and hold a validation split out.

Sources: the shipped corpus (its own train/validation split), a local ``.txt`` (one sentence per line),
``.csv`` (header row) or ``.jsonl`` file, or a Hugging Face dataset name (needs ``datasets`` and the Hub).
A file with a ``split`` column uses its ``validation`` rows; otherwise (and for a ``.txt``) a seeded share
of the sentences is held out for validation, never trained on, and the report says so.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..data import LABELS, Example, load_corpus
from .options import AuditConfig, UsageError

SUFFIXES = (".txt", ".csv", ".jsonl")
TEXT_FIELDS = ("text", "sentence", "content", "document", "utterance")
LABEL_FIELDS = ("label", "labels", "topic", "category", "intent")
MIN_VALIDATION = 4


@dataclass(frozen=True)
class AuditData:
    train: list[Example]
    validation: list[Example]
    source: str  # what the report says about where the sentences came from
    split: str  # how validation was obtained (stated in the report)
    labels: tuple[str, ...]  # class names, index = class id (empty: unlabelled)

    def label_ids(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.labels)}


def load(config: AuditConfig) -> AuditData:
    """Read, decode and check the dataset; raises :class:`UsageError` naming ``--dataset`` and the fix."""
    if config.dataset is None or config.dataset in ("aegis", "corpus", "default"):
        data = AuditData(
            load_corpus("train"),
            load_corpus("validation"),
            "the shipped corpus (aegis.data)",
            "the corpus's own validation split (20 % per topic)",
            LABELS,
        )
    else:
        path = Path(config.dataset).expanduser()
        if path.exists() or path.suffix.lower() in (*SUFFIXES, ".json"):
            data = _from_file(path, config)
        else:
            data = _from_hub(config.dataset, config)
    _check_size(data, config)
    return data


def _fail(message: str) -> UsageError:
    return UsageError("--dataset", message)


def _from_file(path: Path, config: AuditConfig) -> AuditData:
    name = str(config.dataset)
    if not path.exists():
        raise _fail(f"{name}: no such file; name a .txt, .csv or .jsonl file")
    if path.is_dir():
        raise _fail(f"{name} is a folder: name a .txt, .csv or .jsonl file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise _fail(
            f"{name}: unsupported type {suffix or '(no suffix)'!r}; use .txt (one sentence per line), "
            ".csv (header row) or .jsonl"
        )
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise _fail(f"cannot read {name} ({err.strerror or type(err).__name__}): check its permissions") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise _fail(
            f"{name} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}): save it as UTF-8"
        ) from None
    if "\x00" in text:
        raise _fail(f"{name} holds NUL bytes (a binary file?): name a UTF-8 text file")
    if suffix == ".txt":
        if config.text_field or config.label_field:
            raise UsageError(
                "--text-field" if config.text_field else "--label-field",
                "a .txt file has no columns (one sentence per line): use a .csv or .jsonl",
            )
        rows = [{"text": line.strip()} for line in text.splitlines() if line.strip()]
    elif suffix == ".csv":
        try:
            rows = list(csv.DictReader(io.StringIO(text)))
        except csv.Error as err:
            raise _fail(f"{name}: not a readable CSV ({err}): one header row, comma-separated") from None
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise _fail(f"{name} line {number} is not JSON ({err.msg}): one JSON object per line") from None
            if not isinstance(row, dict):
                raise _fail(
                    f"{name} line {number} is a JSON {type(row).__name__}, not an object: "
                    'one {"text": ...} object per line'
                )
            rows.append(row)
    if not rows:
        raise _fail(f"{name} holds no sentences: give one sentence per line (.txt) or one row per sentence")
    return _split(_examples(rows, name, config), rows, name, config)


def _examples(rows: list[dict], name: str, config: AuditConfig) -> list[tuple[Example, str | None]]:
    columns = list(dict.fromkeys(k for row in rows[:50] for k in row if k is not None))
    text_key = config.text_field or next((c for c in TEXT_FIELDS if c in columns), None)
    if text_key is None:
        raise UsageError(
            "--text-field",
            f"{name} has no text column (columns: {', '.join(map(str, columns)) or 'none'}): pass --text-field COLUMN",
        )
    if text_key not in columns:
        raise UsageError("--text-field", f"{name} has no column {text_key!r} (columns: {', '.join(map(str, columns))})")
    label_key = config.label_field or next((c for c in LABEL_FIELDS if c in columns), None)
    if config.label_field is not None and config.label_field not in columns:
        raise UsageError(
            "--label-field", f"{name} has no column {config.label_field!r} (columns: {', '.join(map(str, columns))})"
        )
    out = []
    for row in rows:
        value = row.get(text_key)
        text = "" if value is None else str(value).strip()
        if text:
            label = row.get(label_key) if label_key else None
            label = None if label is None or str(label).strip() == "" else str(label).strip()
            split = row.get("split")
            out.append((Example(text, label), None if split is None else str(split).strip().lower()))
    if not out:
        raise UsageError("--text-field", f"{name}: column {text_key!r} is empty in every row: name the text column")
    return out


def _split(items: Sequence[tuple[Example, str | None]], rows: list[dict], name: str, config: AuditConfig) -> AuditData:
    splits = {s for _, s in items if s is not None}
    if "validation" in splits or "valid" in splits or "dev" in splits:
        held = next(s for s in ("validation", "valid", "dev") if s in splits)
        train = [e for e, s in items if s in (None, "train")]
        validation = [e for e, s in items if s == held]
        how = f"the file's {held!r} rows (column 'split')"
    else:
        examples = [e for e, _ in items]
        order = list(range(len(examples)))
        random.Random(config.seed).shuffle(order)
        cut = max(MIN_VALIDATION, round(config.validation_share * len(examples)))
        cut = min(cut, len(examples) // 2)
        kept = set(order[:cut])
        train = [e for i, e in enumerate(examples) if i not in kept]
        validation = [e for i, e in enumerate(examples) if i in kept]
        how = (
            f"{len(validation)} of {len(examples)} sentences ({config.validation_share:.0%}) held out at random "
            f"(seed {config.seed}), never trained on"
        )
    return AuditData(train, validation, name, how, _label_names(train + validation))


def _label_names(examples: list[Example]) -> tuple[str, ...]:
    present = {e.label for e in examples if e.label is not None}
    if present and present <= set(LABELS):
        return tuple(label for label in LABELS if label in present)
    return tuple(sorted(present))


def _from_hub(name: str, config: AuditConfig) -> AuditData:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise _fail(
            f"{name!r} is not a local file, and reading a Hugging Face dataset needs the 'datasets' "
            "package: pip install datasets, or name a .txt/.csv/.jsonl file"
        ) from None
    from ..loading import hub_reachable

    if not hub_reachable():
        raise _fail(
            f"{name!r} is not a local file and the Hugging Face Hub is not reachable: name a local "
            ".txt/.csv/.jsonl file, or leave --dataset out for the shipped corpus"
        )
    from ..data import load_texts

    try:
        train = load_texts(name, split="train", text_field=config.text_field, label_field=config.label_field)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise _fail(f"{name!r}: {first[:200]}") from None
    try:
        validation = load_texts(name, split="validation", text_field=config.text_field, label_field=config.label_field)
        how = "the dataset's 'validation' split"
    except (RuntimeError, ValueError, KeyError):
        items = [(e, None) for e in train]
        return _split(items, [], name, config)
    return AuditData(train, validation, name, how, _label_names(train + validation))


def needed(config: AuditConfig) -> int:
    """Training sentences the federated rounds consume: clients x rounds x batch size, all distinct."""
    return config.clients * config.rounds * config.batch_size


def _check_size(data: AuditData, config: AuditConfig) -> None:
    need = needed(config)
    if len(data.train) < need:
        raise _fail(
            f"{data.source} has {len(data.train)} training sentences; {config.clients} clients x {config.rounds} "
            f"rounds x batch {config.batch_size} need {need}: add sentences or lower --clients/--rounds/--batch-size"
        )
    if len(data.validation) < MIN_VALIDATION:
        raise _fail(
            f"{data.source} has {len(data.validation)} validation sentences; utility needs at least "
            f"{MIN_VALIDATION}: add sentences"
        )
    if "encoder" in config.models:
        labelled = sum(e.label is not None for e in data.train)
        if len(data.labels) < 2 or labelled < len(data.train):
            what = (
                "no labels"
                if not data.labels
                else (
                    f"{len(data.labels)} label"
                    if len(data.labels) < 2
                    else f"{len(data.train) - labelled} unlabelled rows"
                )
            )
            raise UsageError(
                "--label-field" if config.dataset else "--models",
                f"the encoder trains a classifier, but {data.source} has {what}: name the label column "
                "with --label-field, or pass --models decoder",
            )
