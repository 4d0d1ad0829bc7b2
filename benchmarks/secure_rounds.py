"""Secure rounds on CPU: wall time, CPU time and bytes of one SecAgg+ round at N clients, in process.

``python benchmarks/secure_rounds.py --clients 16 64 256``: one FedSGD round of
:func:`aegis.fl.secure.rounds.run_secure_rounds` per N (a warm-up round at the smallest N first),
every message through Flower's protobuf serde. Model: a one-layer GPT-2 (vocabulary 200, width 32;
the trainable, non-attention parameters are the update, d recorded). SecAgg+ with ``num_shares``
neighbours (default 15) and reconstruction threshold = the clients' pin (default 8, above half the
shares). Recorded per N: wall seconds and process CPU seconds of the round (on a shared machine the
CPU time is the work, the wall time the work plus waits for a core), the 1-minute load average, the
bytes the server sent (instructions) and received (replies), and whether the sum matched the clients'
sum to quantisation. Writes ``secure-rounds-cpu-<cpu>.json`` to --out (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path

import torch
import transformers

from aegis.fl.secure import SurvivorPin
from aegis.fl.secure.rounds import run_secure_rounds


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=200, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def batches(n: int) -> list[list[dict[str, torch.Tensor]]]:
    out = []
    for c in range(n):
        ids = torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(c))
        out.append([{"input_ids": ids, "labels": ids}])
    return out


def one_round(n: int, shares: int, pin: int, clipping_range: float) -> dict:
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    run = run_secure_rounds(model(), batches(n), rounds=1, pin=SurvivorPin(pin), num_shares=min(shares, n),
                            reconstruction_threshold=pin, clipping_range=clipping_range)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    step = 2 * clipping_range / 2**22
    err = max(float((run.sums[1][k] - sum(t.updates[1][i].double() for t in run.trainers)).abs().max())
              for i, k in enumerate(run.names))
    return {
        "clients": n, "num_shares": min(shares, n), "threshold": pin,
        "d": sum(u.numel() for u in run.trainers[0].updates[1]),
        "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "load_1min_before": round(load, 2),
        "bytes_to_clients": run.grid.instruction_bytes, "bytes_from_clients": sum(len(w) for _, _, w in run.grid.wire),
        "max_abs_error": err, "error_bound": n * step + n * clipping_range * 2**-22,
        "sum_matches": err <= n * step + n * clipping_range * 2**-22,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--shares", type=int, default=15)
    p.add_argument("--pin", type=int, default=8)
    p.add_argument("--clipping-range", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    one_round(min(args.clients), args.shares, args.pin, args.clipping_range)  # warm-up: imports, first calls
    rows = []
    for n in args.clients:
        rows.append(one_round(n, args.shares, args.pin, args.clipping_range))
        print(json.dumps(rows[-1]), flush=True)
    cpu = cpu_name()
    record = {"benchmark": "secure-rounds", "cpu": cpu, "cores": os.cpu_count(), "torch_threads": 1, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")
    (args.out / f"secure-rounds-cpu-{name}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
