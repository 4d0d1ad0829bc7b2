"""What AEGIS costs in a training step, beside undefended training and the baselines (issue 6).

One full step = forward, backward, defence, AdamW step. For each model and batch the defences run
side by side in one process on one device; the report gives the median step time, peak allocated
memory and the exported payload (fp32 bytes of what a client shares), and ratios to undefended.

    python benchmarks/overhead.py            # GPU: GPT-2, GPT-2-XL, LLaMA-2-7B architectures
    python benchmarks/overhead.py --quick    # tiny config on CPU, under a minute (CI runs this)

AEGIS runs as shipped: exposure counting on, each defence with a fresh persistent store (SQLite in a
temporary folder). The "+no-exposure" variant turns counting off, so the difference is the counting's
cost; ``counting_ms`` is the time a step waits for the budget decision (taken in the decider process
during the backward: the hashing and the transaction). The flood runs as a CUDA graph (the default);
"+eager-flood" launches it kernel by kernel.
``--drift-steps N`` times N steps of GPT-2 b64 and compares the last 100 with the
first 100 (the store grows by every step's windows).

Random-initialised architectures from configs: no weights are downloaded.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers as T

from aegis.baselines import Aegis, make_defence
from aegis.exposure import ExposurePolicy, create_state

RESULTS = Path(__file__).parent / "results"
# Variants by suffix: "+keep-grads" zeroes gradients in place (zero_grad(set_to_none=False)) so they
# keep their addresses; "+eager-flood" turns AegisConfig.cuda_graph off (the flood's launches one by one).
# "+no-exposure" turns the exposure budget off (the counting's cost is the difference).
KEEP_GRADS, EAGER_FLOOD, NO_EXPOSURE = "keep-grads", "eager-flood", "no-exposure"
DEFENCES = ("none", "aegis-verification", "aegis-verification+no-exposure", "dp-sgd-C1-z1", "prune-90", "soteria-80")


@dataclass(frozen=True)
class Setting:
    model: str
    batch: int
    seq: int
    weights: torch.dtype
    autocast: torch.dtype | None


def gpt2_config(name: str) -> T.GPT2Config:
    sizes = {"gpt2": (12, 768, 12, 50257), "gpt2-xl": (48, 1600, 25, 50257), "tiny-gpt2": (2, 64, 2, 1024)}
    n_layer, n_embd, n_head, vocab = sizes[name]
    return T.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab)


def config_for(name: str):
    if name == "llama-2-7b":
        return T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    return gpt2_config(name)


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("tiny-gpt2", 4, 32, torch.float32, None)]
    return [
        Setting("gpt2", 8, 64, torch.float32, None),
        Setting("gpt2", 64, 64, torch.float32, None),  # GPU-bound: launch overhead no longer hides the defence
        Setting("gpt2-xl", 2, 64, torch.float32, torch.float16),
        Setting("gpt2-xl", 16, 64, torch.float32, torch.float16),
        # bf16 weights: AdamW keeps its states in the parameters' dtype, the same for every defence.
        Setting("llama-2-7b", 4, 64, torch.bfloat16, None),
        Setting("llama-2-7b", 16, 64, torch.bfloat16, None),
    ]


def build(setting: Setting, device: torch.device):
    torch.manual_seed(0)
    config = config_for(setting.model)
    with device:
        model = T.AutoModelForCausalLM.from_config(config, torch_dtype=setting.weights)
    model.config.use_cache = False

    def batch() -> dict[str, torch.Tensor]:  # fresh data every step, as in training (and the exposure budget)
        ids = torch.randint(0, config.vocab_size, (setting.batch, setting.seq), device=device)
        return {"input_ids": ids, "labels": ids}

    return model.train(), batch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prepare(setting: Setting, defence_name: str, device: torch.device):
    """(step, defence): one full training step of a fresh model under the named defence."""
    model, draw = build(setting, device)
    base, *flags = defence_name.split("+")
    if set(flags) - {KEEP_GRADS, EAGER_FLOOD, NO_EXPOSURE}:
        raise ValueError(f"{defence_name}: unknown variant; use +{KEEP_GRADS}, +{EAGER_FLOOD} or +{NO_EXPOSURE}")
    defence = make_defence(base)
    if isinstance(defence, Aegis):
        # as shipped: counts persist, in a store of this defence's own (random batches never repeat in one)
        store = create_state(Path(tempfile.mkdtemp(prefix="aegis-overhead-")) / "exposure.sqlite")
        defence.config = defence.config.replace(
            exposure_state=str(store), cuda_graph=EAGER_FLOOD not in flags,
            exposure=ExposurePolicy.OFF if NO_EXPOSURE in flags else defence.config.exposure)

    def loss_fn(m, b):
        with torch.autocast(device.type, dtype=setting.autocast, enabled=setting.autocast is not None):
            return m(**b).loss

    # AEGIS freezes attention before the optimizer sees it; others keep every parameter.
    defence.attach(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    scaler = torch.amp.GradScaler(device.type, enabled=setting.autocast == torch.float16)
    shield = defence.shield if isinstance(defence, Aegis) else None
    if shield is not None and shield._exposure is not None and shield._exposure.store is not None:
        defence.counting_s = []
        shield._settle = _timed(shield._settle, defence.counting_s)  # the step waiting for the decision

    def step():
        optimizer.zero_grad(set_to_none=KEEP_GRADS not in flags)
        loss = defence.backward(draw(), lambda m, b: scaler.scale(loss_fn(m, b)))
        scaler.unscale_(optimizer)
        defence.defend_()
        scaler.step(optimizer)
        scaler.update()
        return loss

    return step, defence


def timed_step(step, device: torch.device) -> float:
    start = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - start


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_one(setting: Setting, defence_name: str, device: torch.device, warmup: int, steps: int) -> dict:
    step, defence = prepare(setting, defence_name, device)
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [timed_step(step, device) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    payload = sum(t.numel() * 4 for t in defence.export().values())  # fp32 on the wire
    extra = defence.report() | _counting(defence, steps)
    del step, defence
    release(device)
    return {"median_s": statistics.median(times), "peak_bytes": peak, "payload_bytes": payload, **extra}


def run_interleaved(
    setting: Setting, names: list[str], device: torch.device, warmup: int, steps: int
) -> dict[str, dict]:
    """Median step time of each defence, their models side by side and their steps taken in turn, so
    host and clock drift (launch-bound steps vary 20 % between runs) hit every defence alike."""
    prepared = {name: prepare(setting, name, device) for name in names}
    for _ in range(warmup):
        for step, _ in prepared.values():
            step()
    times = {name: [] for name in names}
    for _ in range(steps):
        for name, (step, _) in prepared.items():
            times[name].append(timed_step(step, device))
    out = {
        name: {"median_s": statistics.median(times[name]), **defence.report(), **_counting(defence, steps)}
        for name, (_, defence) in prepared.items()
    }
    del prepared
    release(device)
    return out


def _timed(fn, times: list):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    return call


def _counting(defence, steps: int) -> dict:
    """Median over the timed steps of the time the step waited for the exposure decision (``counting_ms``),
    and the store's size after them."""
    counting = getattr(defence, "counting_s", None)
    if not counting:
        return {}
    out = {"counting_ms": statistics.median(counting[-steps:]) * 1e3}
    store = defence.shield._exposure.store.summary()
    return out | {"store_windows": store.windows, "store_bytes": store.bytes}


def run_drift(setting: Setting, names: list[str], device: torch.device, warmup: int, steps: int) -> dict[str, dict]:
    """Each defence for ``steps`` steps: the median of the last 100 over the median of the first 100."""
    out = {}
    for name in names:
        step, defence = prepare(setting, name, device)
        for _ in range(warmup):
            step()
        sync(device)
        times = [timed_step(step, device) for _ in range(steps)]
        first, last = statistics.median(times[:100]), statistics.median(times[-100:])
        out[name] = {"steps": steps, "first100_ms": first * 1e3, "last100_ms": last * 1e3, "drift": last / first,
                     **_counting(defence, 100)}
        del step, defence
        release(device)
    if "none" in out:
        for row in out.values():
            row["first100_ratio"] = row["first100_ms"] / out["none"]["first100_ms"]
            row["last100_ratio"] = row["last100_ms"] / out["none"]["last100_ms"]
    return out


def run_graphed(setting: Setting, aegis_on: bool, device: torch.device, warmup: int, steps: int) -> dict:
    """The whole step (forward, backward, flood, AdamW) captured once as a CUDA graph and replayed.

    AEGIS runs with ``device_seed=True``: the seed lives on the GPU and the captured flood advances it,
    so every replay draws fresh noise.
    """
    import aegis

    model, draw = build(setting, device)
    batch = draw()  # a replayed graph reads one static batch (training copies new data into it)
    # replays run no Python hook, so the shield cannot count exposures: the step is the caller's
    config = aegis.AegisConfig(device_seed=True, exposure=aegis.ExposurePolicy.OFF, allow_outside_promise=True)
    shield = aegis.protect(model, config=config) if aegis_on else None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, capturable=True)

    def body():
        # Zeroing in place keeps every gradient at one address: the graph and the flood's cached
        # launch tables see the same tensors on every replay.
        optimizer.zero_grad(set_to_none=False)
        model(**batch).loss.backward()
        if shield is not None:
            shield.mask_()
        optimizer.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (allocations, autotuning, optimizer state)
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    model = optimizer = graph = shield = None  # free the device memory before the next setting
    gc.collect()
    torch.cuda.empty_cache()
    return {"median_s": statistics.median(times), "peak_bytes": peak}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny config on CPU, a few steps")
    parser.add_argument("--defences", default=",".join(DEFENCES))
    parser.add_argument("--models", default="", help="comma-separated subset of model names")
    parser.add_argument("--batches", default="", help="comma-separated subset of batch sizes")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--baseline-steps", type=int, default=20,
                        help="timed steps for DP-SGD, pruning and Soteria (5 warm-up): they are 2-20x slower")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of undefended and AEGIS runs (each a fresh model); medians are combined")
    parser.add_argument("--interleave", action="store_true",
                        help="time undefended and AEGIS side by side, steps in turn (memory: all models at once)")
    parser.add_argument("--no-cuda-graph", action="store_true", help="skip the CUDA-graph rows (GPT-2 only)")
    parser.add_argument("--drift-steps", type=int, default=0,
                        help="also time this many steps of GPT-2 b64 (undefended and AEGIS): last 100 vs first 100")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for overhead-<card>.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    warmup, steps = (1, 3) if args.quick else (args.warmup, args.steps)
    card = torch.cuda.get_device_name().replace(" ", "-") if device.type == "cuda" else "cpu"
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"overhead-{card}.json"
    meta = {"card": card, "torch": torch.__version__, "warmup": warmup, "steps": steps,
            "baseline_steps": args.baseline_steps}
    for setting in settings(args.quick):
        if args.models and setting.model not in args.models.split(","):
            continue
        if args.batches and str(setting.batch) not in args.batches.split(","):
            continue
        names = args.defences.split(",")
        runs = {name: [] for name in names}
        for repeat in range(args.repeats):  # rounds of all defences: drift hits each the same
            for name in names:
                slow = not name.startswith(("none", "aegis")) and not args.quick
                if not slow or repeat == 0:
                    runs[name].append(_measure(setting, name, device, 5 if slow else warmup,
                                               args.baseline_steps if slow else steps))
        results = {name: _combine(r) for name, r in runs.items()}
        fast = [n for n in names if n.startswith(("none", "aegis")) and "error" not in results[n]]
        if args.interleave and len(fast) > 1:
            try:
                paired = run_interleaved(setting, fast, device, warmup, steps)
            except torch.OutOfMemoryError:
                release(device)
            else:
                for name, result in paired.items():
                    results[name]["median_s_sequential"] = results[name]["median_s"]
                    results[name] |= {"interleaved": True, **result}
        base = results.get("none")
        base = None if base is None or "error" in base else base
        for name, result in results.items():
            if base and "error" not in result:
                result |= {
                    "time_ratio": result["median_s"] / base["median_s"],
                    "memory_ratio": result["peak_bytes"] / base["peak_bytes"]
                    if base["peak_bytes"]
                    else None,  # CPU: none
                    "payload_ratio": result["payload_bytes"] / base["payload_bytes"],
                }
            rows.append(_row(setting, name, result))
        if device.type == "cuda" and setting.model == "gpt2" and not args.no_cuda_graph:
            graphed = {}
            for name, on in (("none+graph", False), ("aegis-verification+graph", True)):
                try:
                    graphed[name] = run_graphed(setting, on, device, warmup, steps)
                except Exception as err:  # capture limits of a given torch/transformers pair are reported
                    graphed[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            plain = graphed["none+graph"]
            for name, result in graphed.items():
                if "error" not in result and "error" not in plain:
                    result["time_ratio"] = result["median_s"] / plain["median_s"]
                    if base:
                        result["time_ratio_vs_eager_none"] = result["median_s"] / base["median_s"]
                rows.append(_row(setting, name, result))
        # Written after every setting, so a run cut short still leaves its numbers.
        out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    if args.drift_steps:
        drift_setting = settings(args.quick)[0] if args.quick else Setting("gpt2", 64, 64, torch.float32, None)
        fast = [n for n in args.defences.split(",") if n.startswith(("none", "aegis"))]
        drift = run_drift(drift_setting, fast, device, warmup, args.drift_steps)
        for name, row in drift.items():
            print(f"drift {name:>32}: first 100 {row['first100_ms']:.2f} ms, last 100 {row['last100_ms']:.2f} ms, "
                  f"x{row['drift']:.3f}", flush=True)
        out.write_text(json.dumps({**meta, "rows": rows, "drift": drift}, indent=1))
    print(f"wrote {out}")
    return out


def _measure(setting: Setting, name: str, device: torch.device, warmup: int, steps: int) -> dict:
    try:
        return run_one(setting, name, device, warmup, steps)
    except torch.OutOfMemoryError as err:
        gc.collect()
        torch.cuda.empty_cache()
        return {"error": f"out of memory: {str(err).splitlines()[0]}"}
    except Exception as err:  # a baseline that cannot handle a model is reported, not fatal
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def _combine(runs: list[dict]) -> dict:
    """One row from repeated runs: the median of their median step times, the largest peak."""
    errors = [r for r in runs if "error" in r]
    if errors:
        return errors[0]
    medians = [r["median_s"] for r in runs]
    out = {**runs[0], "median_s": statistics.median(medians), "peak_bytes": max(r["peak_bytes"] for r in runs)}
    return out | ({"median_s_repeats": medians} if len(runs) > 1 else {})


def _row(setting: Setting, defence: str, result: dict) -> dict:
    row = {
        **asdict(setting),
        "weights": str(setting.weights),
        "autocast": str(setting.autocast),
        "defence": defence,
        **result,
    }
    print(format_row(row), flush=True)
    return row


def format_row(r: dict) -> str:
    head = f"{r['model']:>11} b={r['batch']:<3} {r['defence']:>24}"
    if "error" in r:
        return f"{head}  {r['error']}"
    memory = "n/a" if r.get("memory_ratio") is None else f"{r['memory_ratio']:.3f}"
    ratios = f"  time×{r['time_ratio']:.3f}" if "time_ratio" in r else ""
    ratios += f"  counting {r['counting_ms']:.2f} ms" if "counting_ms" in r else ""
    if "payload_ratio" in r:
        ratios += f"  mem×{memory}  payload×{r['payload_ratio']:.3f}"
    payload = f"  payload {r['payload_bytes'] / 2**20:8.1f} MiB" if "payload_bytes" in r else ""
    return f"{head}  {r['median_s'] * 1e3:8.2f} ms  peak {r['peak_bytes'] / 2**30:6.2f} GiB{payload}{ratios}"


if __name__ == "__main__":
    main()
