"""Utility you can trust: long federated runs per defence, learning curves and the privacy-utility frontier.

    python benchmarks/utility.py --quick --out benchmarks/results/utility-cpu-quick        # 2 CPU cores, < 3 min
    python benchmarks/utility.py --device cuda --models decoder --algorithms fedsgd \
        --out benchmarks/results/utility-h100                                              # one 9-minute call
    python benchmarks/utility.py --device cuda --models decoder --algorithms fedavg \
        --out benchmarks/results/utility-h100 --append                                     # the next one, merged
    python benchmarks/utility.py --exposure off --fast-noise --defences none,aegis-verification,aegis-sentences \
        --out benchmarks/results/utility-cpu-exposure-off     # the presets' noise alone, nothing silenced (CPU)

--exposure off is a measurement, not a private setting: AEGIS exports every batch however often its examples
were exported before. --fast-noise (CPU) swaps the flood's ChaCha normals for keyed torch.randn
(aegis_kernels.testing): the same law, far cheaper on CPU, no secret stream; report.json records it.

Writes report.json (every curve point, the settings, the machine and card, wall time, the bar per run),
learning_curves.png, frontier.png and report.html into --out. Needs torch + transformers (+ matplotlib for
the figures); Opacus for dp-sgd; the text attacks run where rouge-score is installed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from aegis.audit.options import UsageError
from aegis.exposure import ExposurePolicy
from aegis.utility import DEFENCES, MODELS, UtilityConfig
from aegis.utility.study import previous, study


def names(value: str) -> tuple[str, ...]:
    return tuple(v.strip().lower() for v in value.split(",") if v.strip())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--models", type=names, help=f"comma-separated from {', '.join(MODELS)} (default decoder)")
    p.add_argument("--defences", type=names, help=f"comma-separated from {', '.join(DEFENCES)} (default: all)")
    p.add_argument("--algorithms", type=names, help="fedsgd, fedavg or both (default both)")
    p.add_argument("--attacks", type=names,
                   help="from dager, embedding_norm, mlp_span, spectral, tag, labels, fingerprint_pool "
                   "(default: all but tag that this machine can run; '' for none)")
    p.add_argument("--rounds", type=int, help="rounds (default 300; --quick 3)")
    p.add_argument("--clients", type=int, help="clients (default 8; --quick 2)")
    p.add_argument("--batch-size", type=int, help="sentences per batch (default 4; --quick 2)")
    p.add_argument("--local-steps", type=int,
                   help="FedAvg local steps per round (default 0: one local epoch of the smallest client)",)
    p.add_argument("--eval-every", type=int, help="rounds between evaluations (default 10; --quick 1)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-4; --quick 1e-3)")
    p.add_argument("--attack-clients", type=int, help="clients whose exports are attacked (default 4; --quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exposure", choices=("silence", "off"),
                   help="AEGIS's exposure budget: silence over-budget steps (default) or off (the noise alone; "
                   "a measurement, not a private setting)")
    p.add_argument("--fast-noise", action="store_true",
                   help="CPU: keyed torch.randn instead of the ChaCha normals (recorded as machine.cpu_noise)")
    p.add_argument("--quick", action="store_true", help="the 2-CPU-core variant (< 3 min), same structure")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--out", default="utility-report", help="output folder (created if missing)")
    p.add_argument("--append", action="store_true", help="merge into the study already in --out")
    p.add_argument("--redraw", action="store_true", help="only redraw the figures and page from --out/report.json")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> UtilityConfig:
    changes = {
        k: v
        for k, v in dict(
            models=args.models, defences=args.defences, algorithms=args.algorithms, attacks=args.attacks,
            rounds=args.rounds, clients=args.clients, batch_size=args.batch_size, local_steps=args.local_steps,
            eval_every=args.eval_every, lr=args.lr, attack_clients=args.attack_clients, seed=args.seed,
            exposure=args.exposure and ExposurePolicy(args.exposure),
        ).items()
        if v is not None
    }
    try:
        return UtilityConfig.quick(**changes) if args.quick else UtilityConfig(**changes)
    except UsageError:
        raise
    except ValueError as err:  # an unknown algorithm name (the enum's error)
        raise UsageError("--algorithms", f"{err}: use fedsgd and/or fedavg") from None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.redraw:  # e.g. after a call that ran out of time: report.json holds every finished run
        from aegis.utility.results import refresh
        from aegis.utility.study import write_outputs

        result = previous(Path(args.out))
        if result is None:
            print(f"error: --redraw: no report.json in {args.out}", file=sys.stderr)
            return 2
        refresh(result)
        print(f"wrote {', '.join(map(str, write_outputs(result, Path(args.out))))}")
        return 0
    try:
        config = config_from(args)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device", "cuda is not available here: use --device cpu")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fast_noise:
        from aegis_kernels import testing as fast_noise

        fast_noise.install()
    started = time.time()

    def say(line: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {line}", file=sys.stderr, flush=True)

    result, paths = study(config, args.device, args.out, append=args.append, say=say)
    for line in result["statements"]:
        print(line)
    print(f"wrote {', '.join(map(str, paths))} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
