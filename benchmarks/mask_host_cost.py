"""Host and GPU time of one shield.mask_() on GPT-2 (124M) gradients: the graph replay of the flood
(AegisConfig.cuda_graph=True, gradients at fixed addresses) vs its eager launches (the default), and
the eager path split into the custom op's dispatch and the launcher itself. GPU only.

    python benchmarks/mask_host_cost.py > benchmarks/results/mask-host-cost-<card>.txt
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers as T

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "python")]
import aegis  # noqa: E402
from aegis_kernels import triton_flood as TF  # noqa: E402


def measure(shield, calls=100):
    host, gpu = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        shield.mask_()
        end.record()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(host) * 1e6, statistics.median(gpu) * 1e6


for label, cfg in (("graph", aegis.AegisConfig(cuda_graph=True)), ("eager", aegis.AegisConfig())):
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config()).cuda()
    shield = aegis.protect(model, config=cfg)
    ids = torch.randint(0, 50257, (8, 64), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    for _ in range(3):
        shield.mask_()
    h, g = measure(shield)
    print(f"{label:6s} mask_: host {h:7.1f} us  gpu {g:7.1f} us", flush=True)
    if label == "eager":
        grads = [p.param.grad for p in shield._flooded if p.param.grad is not None]
        tensors, modes, rhos, lams = shield._batch([p.param.grad for p in shield._flooded])
        for name, fn in (("op dispatch", lambda: torch.ops.aegis.flood_(tensors, modes, rhos, lams, 0.01, 123)),
                         ("direct", lambda: TF.flood_(tensors, modes, rhos, lams, 0.01, 123))):
            ts = []
            for _ in range(100):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            print(f"  flood_ {name:12s} host {statistics.median(ts) * 1e6:7.1f} us", flush=True)
        print("  tensors", len(tensors), "modes", sorted(set(modes.split(","))))
    del model, shield
