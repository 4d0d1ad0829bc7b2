"""What the exposure budget costs per export on the host, as the store grows.

For each size (sentences already stored, 64 tokens each: 57 windows a sentence), a fresh store is filled
with that history (sorted runs of 200 000 sentences each), then B = 8 x 64-token batches of fresh
sentences are decided one after another: the counting rule (fingerprints and salted digests of the step's
rows) and the store's transaction (read the counts, reserve, commit). Reports the median per export of
each part, the wait for the WAL's fsync that ``export()`` adds when nothing else overlapped it, the mean
time the store's workers then spend (fsync, checkpoints, and the folds and merges of the log into runs;
a training step's compute overlaps them), and the bytes on disk per stored window.

    python benchmarks/exposure_store.py                    # 1e3, 1e5, 1e6 stored sentences
    python benchmarks/exposure_store.py --sizes 1000 --exports 20
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from aegis.exposure_counting import Counting
from aegis.exposure_store import DURABILITY, MERGES, WINDOW, ExposureStore, bulk_load, create_state

RESULTS = Path(__file__).parent / "results"
BATCH, TOKENS, VOCAB = 8, 64, 49152


def fill(store: ExposureStore, sentences: int, chunk: int = 200_000) -> None:
    """``sentences`` random sentences' worth of windows (the history), loaded as runs of ``chunk`` sentences
    each; the merge policy would have merged some of them, so a decision here reads more runs than it would
    in a store grown by exports."""
    windows = TOKENS - WINDOW + 1
    assert store._db is not None
    rng = np.random.default_rng(1)
    left = sentences * windows
    while left:
        n = min(chunk * windows, left)
        bulk_load(store._db, rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64), np.ones(n, np.int64))
        left -= n


def measure(size: int, exports: int, folder: Path) -> dict:
    path = create_state(folder / f"store-{size}.sqlite")
    store = ExposureStore(str(path))
    start = time.perf_counter()
    fill(store, size)
    fill_s = time.perf_counter() - start
    counting = Counting(store.salt, pad=None, special=frozenset())  # as the decider process runs it
    rng = np.random.default_rng(0)
    hash_s, store_s, durable_s, background_s = [], [], [], []
    for _ in range(exports):
        ids = rng.integers(3, VOCAB, (BATCH, TOKENS))
        t0 = time.perf_counter()
        rows = counting.rows(ids, np.ones_like(ids))
        t1 = time.perf_counter()
        over = store.reserve(rows, budget=1)
        t2 = time.perf_counter()
        store.wait_durable()  # export() waits for this; mask_() does not
        t3 = time.perf_counter()
        DURABILITY.submit(lambda: None).result()  # the worker's fsync and checkpoint, done before the next step
        MERGES.submit(lambda: None).result()  # and a merge, if this export started one
        background_s.append(time.perf_counter() - t2)
        assert over == 0
        hash_s.append(t1 - t0)
        store_s.append(t2 - t1)
        durable_s.append(t3 - t2)
    summary = store.summary()
    return {
        "stored_sentences": size, "stored_windows": summary.windows, "exports": exports,
        "fill_s": fill_s, "hash_ms": statistics.median(hash_s) * 1e3, "store_ms": statistics.median(store_s) * 1e3,
        "total_ms": statistics.median(h + s for h, s in zip(hash_s, store_s)) * 1e3,
        "store_p90_ms": float(np.percentile(store_s, 90)) * 1e3,
        "durable_wait_ms": statistics.median(durable_s) * 1e3,
        "background_mean_ms": statistics.mean(background_s) * 1e3,
        "bytes": summary.bytes, "bytes_per_window": summary.bytes / max(summary.windows, 1),
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,100000,1000000", help="stored sentences, comma-separated")
    parser.add_argument("--exports", type=int, default=200, help="exports timed per size")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores live (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="aegis-store-bench-"))
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "exposure-store-cpu.json"
    for size in (int(s) for s in args.sizes.split(",")):
        row = measure(size, args.exports, folder)
        rows.append(row)
        print(f"{size:>9} sentences ({row['stored_windows']:>10} windows): hash {row['hash_ms']:.2f} ms + store "
              f"{row['store_ms']:.2f} ms (p90 {row['store_p90_ms']:.2f}) per export, worker after it "
              f"{row['background_mean_ms']:.2f} ms (mean); "
              f"{row['bytes_per_window']:.1f} bytes per window", flush=True)
        out.write_text(json.dumps({"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                   "batch": BATCH, "tokens": TOKENS, "rows": rows}, indent=1))
    return out


if __name__ == "__main__":
    main()
