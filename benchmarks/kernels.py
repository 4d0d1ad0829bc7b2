"""Flood kernel benchmark: fused Triton kernels vs the PyTorch reference, eager and
``torch.compile``d, against the copy-bandwidth floor measured in the same run.

    python benchmarks/kernels.py [--out DIR] [--skip-compile] [--only NAME ...] [--baseline DIR]
    python benchmarks/kernels.py --device cpu [--out DIR]   # the CPU flood: benchmarks/kernels_cpu.py

--baseline DIR: a directory holding an earlier ``aegis_kernels`` package (e.g. the Philox stream,
``git archive 4d4065b aegis_kernels | tar -x -C DIR``); its fused floods are timed in the same
run, on the same tensors, as ``baseline_*`` columns.

floor = (bytes of the gradient read once + written once) / measured device-to-device copy
bandwidth (copy bandwidth counts bytes read + bytes written). Times are medians of
``triton.testing.do_bench`` (L2 flushed between calls); calls slower than 0.2 s are timed twice
with CUDA events instead. Writes ``kernels-<card>.json`` to --out (default benchmarks/results).

Rows cases use an embedding gradient with the rows of one batch of 4096 random tokens active
(`sparse`: what a step produces; the fused kernel re-reads only those rows) and, as the worst
case, every row active (`dense`: one extra read of G). Grouped cases flood MLP weights in place
with the preset's rho = 0 (G read once for the norm and the non-finite check, never re-read).
Parameters are public constants (rho, sigma, clip, thr) in a device table, the key 8 device words.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import aegis_kernels  # noqa: F401  (registers the CUDA kernels)
from aegis_kernels import reference as ref
from aegis_kernels.triton import tables
from aegis_kernels.triton.launch import GPU as LAUNCH  # the CUDA launch configuration

ROOT = Path(__file__).resolve().parents[1]

TAU, SEED = 0.01, 0x5EED_1234_5678
LAM_STATIONARY = math.sqrt(math.pi / 2)
BASELINE = None  # the earlier package's triton_flood module (--baseline)


def _key():
    return aegis_kernels.key_from_int(SEED).cuda()


def _rows_params(g: torch.Tensor) -> torch.Tensor:
    """rho 0.3, sigma and clip of the gradient's own scale, thr = tau M: the rows outside the batch
    are not re-read, as in a real step."""
    m_bar, peak = ref.statistic(g, "rows", TAU).unbind()
    return torch.stack((torch.tensor(0.3, device="cuda"), m_bar, 2 * peak, TAU * peak)).float()


def _baseline_module(path: str):
    """``baseline_kernels.triton_flood`` from DIR/baseline_kernels (an earlier aegis_kernels package
    whose __init__ is emptied, so it registers no ops), loaded from its folder by name."""
    import importlib
    import importlib.util

    package = Path(path) / "baseline_kernels"
    spec = importlib.util.spec_from_file_location("baseline_kernels", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"--baseline: no baseline_kernels package in {path}")
    sys.modules["baseline_kernels"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return importlib.import_module("baseline_kernels.triton_flood")


def time_baseline(res: dict, fn) -> None:
    """baseline_ms (eager) and baseline_graph_ms (CUDA-graph replay) of the earlier package's flood."""
    res["baseline_ms"] = timed(fn)
    try:
        res["baseline_graph_ms"] = do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # noqa: BLE001
        res["baseline_graph_error"] = repr(exc)[:300]


def baseline_rows(g):
    return lambda: BASELINE.flood(g, "rows", 0.3, 1.0, TAU, SEED, 0)


def baseline_grouped(grads):
    k = len(grads)
    return lambda: BASELINE.flood_(grads, ",".join(["matrix"] * k), [0.0] * k, [LAM_STATIONARY] * k, TAU, SEED)


def card_name() -> str:
    name = torch.cuda.get_device_name()
    for short in ("h200", "h100", "a100", "l40s", "b200"):
        if short in name.lower():
            return short
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def timed(fn) -> float:
    """Median ms of fn on the GPU."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = start.elapsed_time(end)
    if once > 200.0:  # eager reference on the big cases: two more calls are enough
        times = []
        for _ in range(2):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times + [once])[1]
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read + bytes written."""
    n = 1 << 28  # 1 GiB of fp32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    src = dst = None  # free the 2 GiB before the benchmark
    torch.cuda.empty_cache()
    return 2 * n * 4 / (ms * 1e-3)


def rows_grad(V: int, D: int, dtype, active: str) -> tuple[torch.Tensor, float]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    if active == "dense":
        return torch.randn(V, D, device="cuda", generator=gen).to(dtype), 1.0
    # a tied embedding/LM-head gradient: small dense values everywhere, the batch's tokens large
    g = 1e-4 * torch.randn(V, D, device="cuda", generator=gen)
    tokens = torch.randint(0, V, (4096,), device="cuda", generator=gen).unique()
    g[tokens] += torch.randn(tokens.numel(), D, device="cuda", generator=gen)
    return g.to(dtype), tokens.numel() / V


def profile_kernels(fn, iters: int = 5) -> dict[str, float]:
    """Mean device ms per call of each kernel launched by fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = getattr(evt, "cuda_time_total", 0.0)
        if t and ("kernel" in evt.key or evt.key.startswith("_")):
            out[evt.key] = round(t / iters / 1e3, 4)
    return out


COMPILE_ONLY = False
SKIP_EAGER = False
DYNAMIC = None  # torch.compile's default: static first, dynamic after a shape changes


def bench_rows(name, V, D, dtype, active, compile_ref: bool, extra: bool) -> dict:
    g, frac = rows_grad(V, D, dtype, active)
    elem = g.element_size()
    floor_bytes = 2 * g.numel() * elem
    res = {"name": name, "kind": "rows", "shape": [V, D], "dtype": str(dtype).replace("torch.", ""),
           "active_rows": frac, "rho": 0.3, "lam": 1.0, "floor_bytes": floor_bytes,
           "est_bytes_fused": floor_bytes + frac * g.numel() * elem + 4 * 4 * V}
    if COMPILE_ONLY:
        key, params = _key(), _rows_params(g)
        res["compile_ms"] = bench_compiled(lambda f: f(g, "rows", params, key, 0), res)
        return res
    key, params = _key(), _rows_params(g)
    fused = lambda: torch.ops.aegis.flood(g, "rows", params, key, 0)  # noqa: E731
    res["fused_ms"] = timed(fused)
    print(f"  {name}: fused {res['fused_ms']:.4f} ms", flush=True)
    if extra:
        try:
            res["fused_graph_ms"] = do_bench_cudagraph(fused, rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001
            res["fused_graph_error"] = repr(exc)[:300]
        if BASELINE is not None:
            time_baseline(res, baseline_rows(g))
        LAUNCH.fast_math = False  # the accurate libdevice log, for the record
        try:
            res["fused_accurate_ms"] = timed(fused)
        finally:
            LAUNCH.fast_math = True
        try:
            res["kernels_ms"] = profile_kernels(fused)
        except Exception as exc:  # noqa: BLE001
            res["profile_error"] = repr(exc)[:300]
    if not SKIP_EAGER:
        res["eager_ms"] = timed(lambda: ref.flood(g, "rows", params, key, 0))
        print(f"  {name}: eager {res['eager_ms']:.4f} ms", flush=True)
    torch.cuda.empty_cache()
    if compile_ref:
        res["compile_ms"] = bench_compiled(lambda f: f(g, "rows", params, key, 0), res)
    g = None  # free the gradient before the next case
    torch.cuda.empty_cache()
    return res


_COMPILED = {}


def bench_compiled(call, res) -> float | None:
    """torch.compile of the reference (dynamic shapes: one compile serves several sizes)."""
    f = _COMPILED.setdefault("flood", torch.compile(ref.flood, dynamic=DYNAMIC))
    try:
        t0 = time.time()
        call(f)
        torch.cuda.synchronize()
        res["compile_first_call_s"] = round(time.time() - t0, 1)
        return timed(lambda: call(f))
    except Exception as exc:  # noqa: BLE001
        res["compile_error"] = repr(exc)[:300]
        return None


def bench_grouped(name, shapes, dtype, compile_ref: bool, extra: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    n = sum(g.numel() for g in grads)
    elem = grads[0].element_size()
    k = len(grads)
    modes = ",".join(["matrix"] * k)
    key = _key()
    params = torch.tensor([[0.0, 1e-3, 1.0, 0.0]] * k, device="cuda")  # rho 0: the paper's MLP flood
    res = {"name": name, "kind": "grouped matrix (in place)", "tensors": k, "elements": n,
           "dtype": str(dtype).replace("torch.", ""), "rho": 0.0,
           "floor_bytes": 2 * n * elem, "est_bytes_fused": 2 * n * elem}
    fused = lambda: torch.ops.aegis.flood_(grads, modes, params, key)  # noqa: E731
    res["fused_ms"] = timed(fused)
    if extra:
        try:
            res["fused_graph_ms"] = do_bench_cudagraph(fused, rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001
            res["fused_graph_error"] = repr(exc)[:300]
        try:
            res["kernels_ms"] = profile_kernels(fused, iters=2)
        except Exception as exc:  # noqa: BLE001
            res["profile_error"] = repr(exc)[:300]
        if BASELINE is not None:
            time_baseline(res, baseline_grouped(grads))
    if not SKIP_EAGER:
        res["eager_ms"] = timed(lambda: ref.flood_many_(grads, ["matrix"] * k, params, key))
    torch.cuda.empty_cache()
    if compile_ref:
        offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in grads])

        def call(f):
            for g, p, off in zip(grads, params, offsets):
                out, _ = f(g.view(-1), "matrix", p, key, off)
                g.copy_(out.view_as(g))

        res["compile_ms"] = bench_compiled(call, res)
    grads = None  # free the gradients before the next case
    torch.cuda.empty_cache()
    return res


def gpt2_mlp():
    shapes = []
    for _ in range(12):  # GPT-2 small: Conv1D c_fc [768, 3072], c_proj [3072, 768] and biases
        shapes += [(768, 3072), (3072,), (3072, 768), (768,)]
    return shapes


def llama7b_mlp():
    return [(11008, 4096), (11008, 4096), (4096, 11008)] * 32  # gate, up, down


CASES = {
    "rows-50257x768-fp32": lambda c, x: bench_rows("rows-50257x768-fp32", 50257, 768, torch.float32, "sparse", c, x),
    "rows-50257x768-fp32-dense": lambda c, x: bench_rows(
        "rows-50257x768-fp32-dense", 50257, 768, torch.float32, "dense", c, x
    ),
    "rows-32000x4096-bf16": lambda c, x: bench_rows(
        "rows-32000x4096-bf16", 32000, 4096, torch.bfloat16, "sparse", c, x
    ),
    "rows-32000x4096-bf16-dense": lambda c, x: bench_rows(
        "rows-32000x4096-bf16-dense", 32000, 4096, torch.bfloat16, "dense", c, x
    ),
    "rows-128256x4096-bf16": lambda c, x: bench_rows(
        "rows-128256x4096-bf16", 128256, 4096, torch.bfloat16, "sparse", c, x
    ),
    "grouped-gpt2-mlp-fp32": lambda c, x: bench_grouped("grouped-gpt2-mlp-fp32", gpt2_mlp(), torch.float32, c, x),
    "grouped-llama7b-mlp-bf16": lambda c, x: bench_grouped(
        "grouped-llama7b-mlp-bf16", llama7b_mlp(), torch.bfloat16, c, x
    ),
}


KNOBS = ("rows_tile1", "rows_warps1", "rows_tile2", "rows_warps", "row_split", "rows_bd2", "rows_warps2",
         "sum_block", "sum_iters", "sum_unroll", "flood_block", "flood_iters", "pipe_warps", "pipe_chunks")
# (sweep timings use do_bench, eager: compare variants with each other, not with the graph column)


def sweep() -> list[dict]:
    """Block/warp variants of the fused kernels on the bar cases (whole op timed; {} = defaults)."""
    out = []
    saved = {k: getattr(LAUNCH, k) for k in KNOBS}

    def run(case, fn, **knobs):
        for key, value in knobs.items():
            setattr(LAUNCH, key, value)
        tables.clear_caches()
        try:
            out.append({"case": case, **{k.strip("_").lower(): v for k, v in knobs.items()},
                        "ms": do_bench_cudagraph(fn, rep=50, return_mode="median")})
        except Exception as exc:  # noqa: BLE001
            out.append({"case": case, **knobs, "error": repr(exc)[:200]})
        print(json.dumps(out[-1]), flush=True)
        for key, value in saved.items():
            setattr(LAUNCH, key, value)
        tables.clear_caches()

    try:
        key = _key()
        g, _ = rows_grad(50257, 768, torch.float32, "sparse")
        p = _rows_params(g)
        f = lambda: torch.ops.aegis.flood(g, "rows", p, key, 0)  # noqa: E731
        c = "rows 50257x768 fp32"
        run(c, f)
        run(c, f, rows_warps2=4)
        run(c, f, rows_bd2=256, rows_warps2=2)
        run(c, f, rows_bd2=256, rows_warps2=1)
        g = None
        g, _ = rows_grad(32000, 4096, torch.bfloat16, "sparse")
        p = _rows_params(g)
        f = lambda: torch.ops.aegis.flood(g, "rows", p, key, 0)  # noqa: E731
        c = "rows 32000x4096 bf16"
        run(c, f)
        run(c, f, rows_bd2=1024, rows_warps2=4)
        run(c, f, rows_bd2=512, rows_warps2=2)
        run(c, f, rows_bd2=2048, rows_warps2=4)
        g = None
        for dtype, shapes, c in ((torch.float32, gpt2_mlp(), "grouped gpt2 mlp fp32"),
                                 (torch.bfloat16, llama7b_mlp()[:24], "grouped llama mlp bf16 x24")):
            gen = torch.Generator(device="cuda").manual_seed(1)
            grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
            k = len(grads)
            pk = torch.tensor([[0.0, 1e-3, 1.0, 0.0]] * k, device="cuda")
            f = lambda: torch.ops.aegis.flood_(grads, ",".join(["matrix"] * k), pk, key)  # noqa: E731, B023
            run(c, f)
            run(c, f, pipe_warps=8)
            run(c, f, flood_block=1024, flood_iters=16)
            run(c, f, flood_block=1024, flood_iters=16, pipe_warps=2)
            run(c, f, pipe_chunks=8)
            grads = None
    finally:
        for key, value in saved.items():
            setattr(LAUNCH, key, value)
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time block/warp variants")
    ap.add_argument("--compile-only", action="store_true", help="only torch.compile of the reference")
    ap.add_argument("--compile-grouped", action="store_true", help="also torch.compile the grouped reference")
    ap.add_argument("--skip-eager", action="store_true", help="do not time the eager PyTorch reference")
    ap.add_argument("--baseline", default=None, help="directory holding an earlier baseline_kernels package")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the numba CPU flood and mask_() / forward + backward (benchmarks/kernels_cpu.py)")
    args = ap.parse_args()
    if args.device == "cpu":
        import kernels_cpu

        kernels_cpu.main(args.out)
        return
    global COMPILE_ONLY, BASELINE, SKIP_EAGER
    SKIP_EAGER = args.skip_eager
    if args.baseline:
        BASELINE = _baseline_module(args.baseline)
    COMPILE_ONLY = args.compile_only
    assert torch.cuda.is_available(), "the kernel benchmark needs a CUDA device"
    card = card_name()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} | copy bandwidth {bw / 1e12:.3f} TB/s (read+write)", flush=True)
    results = []
    sweeps = sweep() if args.sweep and not COMPILE_ONLY else []
    for name, run in CASES.items():
        if args.only and name not in args.only:
            continue
        extra = not name.endswith("-dense")
        t0 = time.time()
        try:
            want = (
                not args.skip_compile
                and not name.endswith("-dense")
                and (name.startswith("rows") or args.compile_grouped)
            )
            if COMPILE_ONLY and not want:
                continue
            res = run(want, extra)
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            res = {"name": name, "error": repr(exc)[:500]}
        res["floor_ms"] = res["floor_bytes"] / bw * 1e3 if "floor_bytes" in res else None
        for key in ("fused", "fused_graph", "fused_accurate", "baseline", "baseline_graph", "eager", "compile"):
            if res.get(f"{key}_ms") and res.get("floor_ms"):
                res[f"{key}_x_floor"] = res[f"{key}_ms"] / res["floor_ms"]
        if res.get("compile_ms") and res.get("fused_ms"):
            res["compile_over_fused"] = res["compile_ms"] / res["fused_ms"]
        res["wall_s"] = round(time.time() - t0, 1)
        results.append(res)
        print(json.dumps(res), flush=True)
        doc = {  # rewritten after every case, so a run cut short keeps what it measured
            "device": torch.cuda.get_device_name(), "card": card, "copy_bandwidth_Bps": bw,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "fast_math": LAUNCH.fast_math, "chacha_rounds": ref.ROUNDS, "method": __doc__, "results": results,
            "sweep": sweeps, "baseline": args.baseline,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"kernels-{card}.json").write_text(json.dumps(doc, indent=1))
    f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    print(f"\n{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s; ms (x floor)")
    print(f"{'case':30s} {'active':>6s} {'floor':>8s} {'fused':>15s} {'graph':>15s} {'base graph':>15s} {'eager':>17s} "
          f"{'compile':>17s} {'cmp/fused':>9s}")
    for r in results:
        if "error" in r and "fused_ms" not in r:
            print(f"{r['name']:30s} ERROR {r['error'][:80]}")
            continue
        cell = lambda k: f"{f(r.get(k + '_ms'))} ({f(r.get(k + '_x_floor'), 2)})"  # noqa: E731, B023
        print(f"{r['name']:30s} {f(r.get('active_rows', 1.0), 3):>6s} {f(r['floor_ms']):>8s} {cell('fused'):>15s} "
              f"{cell('fused_graph'):>15s} {cell('baseline_graph'):>15s} {cell('eager'):>17s} {cell('compile'):>17s} "
              f"{f(r.get('compile_over_fused'), 1):>9s}")


if __name__ == "__main__":
    main()
