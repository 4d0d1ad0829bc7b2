"""Where the rows flood's time goes (issue 3): the noise pipeline stage by stage, write-only.

    python benchmarks/noise_breakdown.py [--out DIR] [--n-rows 32000] [--dim 4096]

Every variant writes the same bf16 V x d tile (what the flood pass writes for inactive rows) and
adds one stage of the noise generator: zeros (write bandwidth), Philox words only, Philox + int->float
(hardware I2F as in production, or an exponent trick on the FMA / integer pipes), Box-Muller (hardware
lg2/sqrt/sin/cos) over either conversion. An earlier run also tried sin/cos as FMA polynomials: slower
(198.7 vs 148.5 us, H200). Dumps the production variant's SASS and counts its opcodes. Writes
``noise-breakdown-<card>.json``.
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
def _to_float31(j):
    """float32(j), 0 <= j < 2^31, without I2F: halves of 15 and 16 bits convert exactly through the
    2^23 exponent trick, and their one rounded sum is the correctly rounded float(j)."""
    hi = ((j >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    lo = ((j & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return hi * 65536.0 + lo


@triton.jit
def _alu_uniform(x):
    return _to_float31(TF._fold31(x)) * TF.UNIFORM_SCALE


@triton.jit
def _box_muller_alu(x1, x2):
    u1 = tl.maximum(TF.MIN_UNIFORM, _alu_uniform(x1))
    r = tl.sqrt(TF._libdevice.fast_log2f(u1) * -1.3862943611198906)
    th = _to_float31(TF._fold31(x2)) * (TF.TWO_PI * TF.UNIFORM_SCALE)
    return r * TF._libdevice.fast_cosf(th), r * TF._libdevice.fast_sinf(th)


@triton.jit
def _stage(x0, x1, x2, x3, STAGE: tl.constexpr):
    if STAGE == 1:  # Philox words only
        return (x0.to(tl.float32, bitcast=True), x1.to(tl.float32, bitcast=True),
                x2.to(tl.float32, bitcast=True), x3.to(tl.float32, bitcast=True))
    elif STAGE == 2:  # + hardware int -> float (production)
        return TF._uniform(x0), TF._uniform(x1), TF._uniform(x2), TF._uniform(x3)
    elif STAGE == 3:  # + int -> float on the FMA / integer pipes
        return _alu_uniform(x0), _alu_uniform(x1), _alu_uniform(x2), _alu_uniform(x3)
    elif STAGE == 4:  # production Box-Muller
        z0, z1 = TF._box_muller(x0, x1, 1.0, True)
        z2, z3 = TF._box_muller(x2, x3, 1.0, True)
        return z0, z1, z2, z3
    else:  # Box-Muller over the FMA / integer pipe conversion
        z0, z1 = _box_muller_alu(x0, x1)
        z2, z3 = _box_muller_alu(x2, x3)
        return z0, z1, z2, z3


@triton.jit(do_not_specialize=["seed"])
def _variant_kernel(out_ptr, n, seed, BLOCK: tl.constexpr, STAGE: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = TF._quad(BLOCK // 4)
    if STAGE == 0:
        z = tl.zeros([BLOCK // 4, 4], tl.float32)
    else:
        k0, k1 = TF._seed_words(seed)
        c = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint64, bitcast=True)
        zero = tl.zeros(c.shape, tl.uint32)
        x0, x1, x2, x3 = TF._philox(k0, k1, c.to(tl.uint32), (c >> 32).to(tl.uint32), zero, zero)
        z0, z1, z2, z3 = _stage(x0, x1, x2, x3, STAGE)
        z = TF._interleave4(z0, z1, z2, z3)
    tl.store(out_ptr + start + offs, z.to(out_ptr.dtype.element_ty), mask=offs < n - start)


STAGES = {"zeros": 0, "philox": 1, "philox + I2F": 2, "philox + ALU int->float": 3,
          "box-muller (production)": 4, "box-muller over ALU int->float": 5}


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
                rows[key]["sass"] = sass_histogram(compiled, Path(args.out) / f"sass-stage{stage}.txt" if stage == 4 else None)
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
