"""CPU flood benchmark (``python benchmarks/kernels.py --device cpu``): the numba flood against the
PyTorch reference, and ``mask_()`` against forward + backward in a training step, one thread and
all threads, in one run.

* flood throughput: ``torch.ops.aegis.flood_`` in place over a decoder-sized set (a 30522 x 384 rows
  tensor and 36 matrices, 22.3 M values) in fp32 and bf16, GB/s of gradient (bytes of the tensors);
  the reference's on a 1 M-value slice of the same set (it is linear in the size).
* training step: ``aegis.protect(model, optimizer)`` (the default preset) on the embedded
  decoder (``aegis.models.default_decoder()``) at B = 4 x 64 and 4 x 16 tokens and on SmolLM2-135M
  (``aegis.smollm2.load_smollm2``, skipped if its weights cannot be found) at B = 8 x 64 tokens; fresh
  random tokens every step; medians over the timed steps of forward + backward and of ``mask_()``,
  wall-clock and CPU seconds (the process's, all threads: on a shared machine the CPU time is the work,
  the wall-clock time the work plus the waits for a core).
  The reference's ``mask_()`` (numba hidden) is timed for one step of the first case, one thread.

"one thread": torch.set_num_threads(1) and aegis_kernels.cpu.set_threads(1); "all threads": both at
os.cpu_count(). The 1-minute load average is recorded before and after every measurement: the machine
may be shared. Writes ``kernels-cpu-<cpu>.json`` to --out (default benchmarks/results).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

import aegis_kernels
from aegis_kernels import cpu
from aegis_kernels import reference as ref

SEED = 0x5EED_C0DE


def cpu_model() -> tuple[str, str, list[str]]:
    """(model name from /proc/cpuinfo, short name for the file, its vector extensions)."""
    name, model, flags = platform.processor() or "cpu", "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("cpu", platform.processor()):
                name = value.strip()
            elif key.strip() == "model" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = [f for f in value.split() if f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl")]
    except OSError:
        pass
    short = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*", "", name.lower())
    short = re.sub(r"[^a-z0-9]+", "-", short).strip("-") or "cpu"
    return name, f"{short}-m{model}" if model else short, flags


def load() -> float:
    return round(os.getloadavg()[0], 2)


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    cpu.set_threads(n)


def decoder_set(dtype: torch.dtype) -> tuple[list[torch.Tensor], str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    shapes = [(30522, 384)] + [(384, 384)] * 24 + [(1536, 384)] * 12
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    modes = ",".join(["rows"] + ["matrix"] * (len(shapes) - 1))
    params = torch.tensor([[0.3, 1e-3, 1.0, 1e-4]] + [[0.0, 1e-3, 1.0, 0.0]] * (len(shapes) - 1))
    return grads, modes, params


def median_s(fn, repeats: int) -> tuple[float, float]:
    """Median wall-clock and CPU seconds (the process's, all threads) of fn, after one warm-up call."""
    fn()
    wall, cpu_s = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu_s.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu_s)


def flood_throughput(threads: int) -> list[dict]:
    out = []
    key = aegis_kernels.key_from_int(SEED)
    for dtype in (torch.float32, torch.bfloat16):
        grads, modes, params = decoder_set(dtype)
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        before = load()
        s, c = median_s(lambda: torch.ops.aegis.flood_(grads, modes, params, key), 5)  # noqa: B023
        row = {"case": "flood_ decoder set", "dtype": str(dtype).replace("torch.", ""), "threads": threads,
               "values": sum(g.numel() for g in grads), "bytes": nbytes, "numba_s": s, "numba_cpu_s": c,
               "numba_GBps": nbytes / s / 1e9, "numba_GB_per_cpu_s": nbytes / c / 1e9,
               "load_before": before, "load_after": load()}
        if threads == 1:
            part = grads[0].reshape(-1)[: 1 << 20]
            s_ref, c_ref = median_s(lambda: ref.flood_many_([part], ["matrix"], params[1:2], key), 2)  # noqa: B023
            part_bytes = part.numel() * part.element_size()
            row["reference_GBps"], row["reference_GB_per_cpu_s"] = part_bytes / s_ref / 1e9, part_bytes / c_ref / 1e9
            row["numba_over_reference"] = row["numba_GBps"] / row["reference_GBps"]
            row["numba_over_reference_cpu"] = row["numba_GB_per_cpu_s"] / row["reference_GB_per_cpu_s"]
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _decoder(seq: int):
    from aegis.models import default_decoder

    model, _ = default_decoder()
    return model, 4, seq


def _smollm2():
    from aegis.smollm2 import load_smollm2

    model, _ = load_smollm2(fetch=False)
    return model, 8, 64


def training_step(name: str, build, threads: int, steps: int, reference_step: bool) -> dict:
    import aegis

    torch.manual_seed(SEED)
    model, batch, seq = build()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    shield = aegis.protect(model, optimizer)
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(SEED + 1000 * threads + seq)  # fresh examples each run (exposure budget)
    fwd_bwd, mask, fwd_bwd_cpu, mask_cpu = [], [], [], []
    before = load()
    for step in range(steps + 1):  # step 0: warm-up (calibration, first calls)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        t, c = time.perf_counter(), time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        t1, c1 = time.perf_counter(), time.process_time()
        shield.mask_()
        t2, c2 = time.perf_counter(), time.process_time()
        if step:
            fwd_bwd.append(t1 - t)
            mask.append(t2 - t1)
            fwd_bwd_cpu.append(c1 - c)
            mask_cpu.append(c2 - c1)
    flooded = sum(p.numel() for p in model.parameters() if p.grad is not None)
    row = {"case": f"{name} B={batch}x{seq}", "preset": str(shield.config.preset), "threads": threads,
           "steps": steps, "flooded_values": flooded,
           "fwd_bwd_s": statistics.median(fwd_bwd), "mask_s": statistics.median(mask),
           "fwd_bwd_cpu_s": statistics.median(fwd_bwd_cpu), "mask_cpu_s": statistics.median(mask_cpu),
           "load_before": before, "load_after": load()}
    row["mask_over_fwd_bwd"] = row["mask_s"] / row["fwd_bwd_s"]
    row["mask_over_fwd_bwd_cpu"] = row["mask_cpu_s"] / row["fwd_bwd_cpu_s"]
    if reference_step:  # the reference's mask_(), numba hidden from the registered op
        from aegis_kernels import ops

        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        has, warned = cpu.HAS_NUMBA, ops._WARNED
        cpu.HAS_NUMBA, ops._WARNED = False, True
        try:
            t = time.perf_counter()
            shield.mask_()
            row["reference_mask_s"] = time.perf_counter() - t
        finally:
            cpu.HAS_NUMBA, ops._WARNED = has, warned
        row["reference_mask_over_fwd_bwd"] = row["reference_mask_s"] / row["fwd_bwd_s"]
    print(json.dumps(row), flush=True)
    return row


def main(out_dir: str, steps: int = 5) -> Path:
    os.environ.setdefault("AEGIS_CACHE_DIR", tempfile.mkdtemp(prefix="aegis-bench-"))  # exposure counts
    name, short, flags = cpu_model()
    cores = os.cpu_count() or 1
    print(f"CPU {name} ({cores} logical cores), torch {torch.__version__}, load {load()}", flush=True)
    models = [("embedded decoder", functools.partial(_decoder, 64)),
              ("embedded decoder", functools.partial(_decoder, 16))]
    skipped = None
    try:
        from aegis.smollm2 import find_gguf

        find_gguf(fetch=False)
        models.append(("SmolLM2-135M", _smollm2))
    except (ImportError, FileNotFoundError) as exc:
        skipped = f"SmolLM2 skipped: {exc}"
        print(skipped, flush=True)
    doc: dict = {"cpu": name, "cpu_short": short, "cpu_flags": flags, "logical_cores": cores,
                 "torch": torch.__version__, "python": platform.python_version(), "chacha_rounds": ref.ROUNDS,
                 "method": __doc__,
                 "note": "shared machine: other engineers' jobs ran beside this one; see load_before / load_after",
                 "skipped": skipped, "flood": [], "steps": []}
    path = Path(out_dir) / f"kernels-cpu-{short}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = torch.get_num_threads()
    try:
        for threads in sorted({1, cores}):
            set_threads(threads)
            doc["flood"] += flood_throughput(threads)
            for label, build in models:
                decoder = "decoder" in label
                doc["steps"].append(training_step(label, build, threads, steps if decoder else 3,
                                                  reference_step=threads == 1 and decoder and not doc["steps"]))
                path.write_text(json.dumps(doc, indent=1))  # kept if a later case is cut short
    finally:
        torch.set_num_threads(saved)
        cpu.set_threads(None)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return path
