"""Where the rows flood's time goes (issue 3): the noise pipeline stage by stage, write-only.

    python benchmarks/noise_breakdown.py [--out DIR] [--n-rows 32000] [--dim 4096]

Every variant writes the same bf16 V x d tile (what the flood pass writes for inactive rows) and
adds one stage of the noise generator: zeros (write bandwidth), Philox words only, Philox + the
int -> float conversions, Box-Muller (hardware lg2/sqrt/sin/cos). Dumps the production variant's SASS
and counts its opcodes. Writes ``noise-breakdown-<card>.json``.

``results/noise-breakdown-h200.json`` was measured on the earlier stream of four normals per Philox
call (zeros 60 us, Philox 100, + I2F 125, + Box-Muller 139 on an H200): the Philox call alone was
slower than the write floor, which is why the stream now takes eight normals per call (two per word).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from aegis_kernels import triton_flood as TF  # noqa: E402

# kernels.py by path: an installed package may also be called "benchmarks"
_spec = importlib.util.spec_from_file_location("aegis_kernel_bench", Path(__file__).with_name("kernels.py"))
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
card_name, copy_bandwidth = _bench.card_name, _bench.copy_bandwidth

SEED = 0x5EED_1234_5678


@triton.jit
def _stage(x, STAGE: tl.constexpr):
    """Two outputs from one Philox word, up to the given stage."""
    if STAGE == 1:  # Philox words only
        return x.to(tl.float32, bitcast=True), (x ^ 1).to(tl.float32, bitcast=True)
    elif STAGE == 2:  # + the int -> float conversions (radius uniform, angle)
        return TF._uniform(x), (x & TF.ANGLE_MASK).to(tl.float32) * TF.ANGLE_STEP
    else:  # production Box-Muller
        return TF._box_muller(x, 1.0, True)


@triton.jit(do_not_specialize=["seed"])
def _variant_kernel(out_ptr, n, seed, BLOCK: tl.constexpr, STAGE: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = TF._lanes(BLOCK // TF.LANES)
    if STAGE == 0:
        z = tl.zeros([BLOCK // TF.LANES, TF.LANES], tl.float32)
    else:
        k0, k1 = TF._seed_words(seed)
        c = (start // TF.LANES + tl.arange(0, BLOCK // TF.LANES)).to(tl.uint64, bitcast=True)
        zero = tl.zeros(c.shape, tl.uint32)
        x0, x1, x2, x3 = TF._philox(k0, k1, c.to(tl.uint32), (c >> 32).to(tl.uint32), zero, zero)
        z0, z1 = _stage(x0, STAGE)
        z2, z3 = _stage(x1, STAGE)
        z4, z5 = _stage(x2, STAGE)
        z6, z7 = _stage(x3, STAGE)
        z = TF._interleave(z0, z1, z2, z3, z4, z5, z6, z7)
    tl.store(out_ptr + start + offs, z.to(out_ptr.dtype.element_ty), mask=offs < n - start)


STAGES = {"zeros": 0, "philox": 1, "philox + I2F": 2, "box-muller (production)": 3}


def sass_histogram(compiled, dump: Path | None = None) -> dict[str, int]:
    try:
        sass = compiled.asm["sass"]
    except Exception as exc:  # no disassembler in this build
        return {"unavailable": f"{type(exc).__name__}: {exc}"[:120], "asm": sorted(compiled.asm)}
    if dump is not None:
        dump.write_text(sass if isinstance(sass, str) else sass.decode())
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if m:
            ops[m.group(1) + (m.group(2) or "")] += 1
    return dict(ops.most_common())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--n-rows", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=4096)
    args = parser.parse_args()
    bw = copy_bandwidth()
    out = torch.empty(args.n_rows, args.dim, dtype=torch.bfloat16, device="cuda")
    n = out.numel()
    floor_ms = n * out.element_size() / bw * 1e3 * 2  # copy bandwidth counts read + write
    rows = {}
    for name, stage in STAGES.items():
        for block, warps in ((1024, 4), (2048, 8), (4096, 8)):
            grid = (triton.cdiv(n, block),)
            compiled = _variant_kernel[grid](out, n, TF._seed_arg(SEED), BLOCK=block, STAGE=stage, num_warps=warps)
            ms = do_bench(lambda: _variant_kernel[grid](out, n, TF._seed_arg(SEED), BLOCK=block, STAGE=stage,
                                                          num_warps=warps), warmup=25, rep=200, return_mode="median")
            key = f"{name} [{block}/{warps}w]"
            rows[key] = {"ms": ms, "write_floor_ms": floor_ms / 2, "x_write_floor": ms / (floor_ms / 2)}
            if block == 2048:
                rows[key]["sass"] = sass_histogram(compiled, Path(args.out) / f"sass-stage{stage}.txt" if stage == 3 else None)
            print(f"{key:42s} {ms * 1e3:8.1f} us  {ms / (floor_ms / 2):5.2f}x write floor", flush=True)
    report = {"card": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "shape": [args.n_rows, args.dim],
              "dtype": "bfloat16", "rows": rows}
    path = Path(args.out) / f"noise-breakdown-{card_name()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    for key, row in rows.items():
        if "sass" in row:
            top = list(row["sass"].items())[:14]
            print(key, top)
    print("wrote", path)


if __name__ == "__main__":
    main()
