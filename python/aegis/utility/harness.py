"""One utility study: for each model x algorithm x defence, a federated run (:mod:`.federation`), its
learning curve, the silenced share of exports, DP-SGD's epsilon, and the attacks on the first, middle and
last round's exports (:mod:`.privacy`). The result is plain JSON-ready data (:mod:`.results`)."""

from __future__ import annotations

import copy
import os
import platform
import time
from collections.abc import Callable

import torch

from ..audit.options import AuditConfig
from ..audit.runner import batch_builder, load_model
from ..data import LABELS, load_corpus
from ..harness.evaluate import evaluator, metric_of
from . import privacy
from .config import CHACHA, UtilityConfig
from .federation import federate
from .results import statements, summarise
from .split import dirichlet_split

Sink = Callable[[dict], None]


def machine(device: torch.device) -> dict:
    """Where the numbers come from (the card for GPU runs)."""
    out = {
        "device": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        out["card"] = torch.cuda.get_device_name(device)
    else:  # timings on shared cores mean little without what else ran
        out["load_average"] = round(os.getloadavg()[0], 2)
        out["cpu_noise"] = cpu_noise()
    return out


def cpu_noise() -> str:
    """Where the CPU flood's normals come from: the shipped cipher, or what a benchmark swapped in for it."""
    import aegis_kernels.reference as reference

    source = reference.noise_components
    if source.__module__ == reference.__name__:
        return CHACHA
    return f"{source.__module__}.{source.__qualname__}"


def load(kind: str, config: UtilityConfig):
    """The audit's model of ``kind`` (whatever ``aegis.models`` makes the default), and its tokenizer."""
    audit = AuditConfig(models=(kind,), defences=("none",), seed=config.seed,
                        decoder=config.decoder if kind == "decoder" else None,
                        encoder=config.encoder if kind == "encoder" else None)
    return load_model(kind, audit, num_labels=len(LABELS))


def attack_names(config: UtilityConfig) -> tuple[str, ...]:
    return config.attacks if config.attacks is not None else privacy.DEFAULT_ATTACKS


def run_utility(
    config: UtilityConfig,
    device: str | torch.device = "cpu",
    *,
    sink: Sink | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run every model x algorithm x defence; ``sink(result)`` after each run so a late failure keeps the rest."""
    device = torch.device(device)
    sink = sink or (lambda result: None)
    say = progress or (lambda line: None)
    started = time.time()
    train, validation = load_corpus("train"), load_corpus("validation")
    label_ids = {name: i for i, name in enumerate(LABELS)}
    result: dict = {
        "settings": config.as_dict(),
        "data": {"source": "the shipped corpus (aegis.data)", "train": len(train), "validation": len(validation),
                 "validation_used": min(config.max_eval, len(validation))},
        "machine": machine(device),
        "attacked_rounds": list(config.attacked_rounds()),
        "references": [],
        "nulls": [],
        "runs": [],
        "wall_seconds": 0.0,
    }
    names = attack_names(config)
    for kind in config.models:
        model, tok = load(kind, config)
        build = batch_builder(kind, tok, label_ids)
        shards = dirichlet_split(train, config.clients, config.dirichlet_alpha, config.seed, config.batch_size)
        evaluate = evaluator(kind, build, validation[: config.max_eval], len(LABELS))
        untrained = evaluate(model)
        result["references"].append(
            {"model": kind, "metric": metric_of(kind), "untrained": untrained, "model_class": type(model).__name__,
             "client_sizes": [len(s) for s in shards],
             "client_labels": [{lab: sum(e.label == lab for e in s) for lab in LABELS} for s in shards]}
        )
        attacked = {id(e) for s in shards[: config.attack_clients] for e in s}
        decoys = [e for e in validation + train if id(e) not in attacked]
        ctx = privacy.context(kind, copy.deepcopy(model), tok, build, label_ids, decoys, config)
        runnable = [n for n in names if privacy.unavailable(n) is None and (n != "labels" or kind == "encoder")]
        null_rows = privacy.nulls(ctx, runnable, shards[0][: config.batch_size])
        result["nulls"] += [{"model": kind, **row} for row in null_rows.values()]
        for algorithm in config.algorithms:
            for defence in config.defences:
                say(f"{kind} · {algorithm.value} · {defence}")
                t0 = time.time()

                def tick(r: int, label=f"{kind} · {algorithm.value} · {defence}") -> None:
                    if r % max(1, config.rounds // 10) == 0:
                        say(f"{label} · round {r}/{config.rounds}")

                try:
                    row = _one_run(kind, algorithm, defence, model, shards, build, evaluate, config, device, tick,
                                   ctx, names, null_rows)
                except Exception as err:  # one broken baseline must not lose the other runs
                    row = {"model": kind, "algorithm": algorithm.value, "defence": defence,
                           "metric": metric_of(kind), "error": f"{type(err).__name__}: {' '.join(str(err).split())}"}
                    say(f"{kind} · {algorithm.value} · {defence} failed: {row['error'][:200]}")
                row["seconds"] = round(time.time() - t0, 1)
                result["runs"].append(row)
                result["wall_seconds"] = round(time.time() - started, 1)
                result["summary"] = summarise(result)
                result["statements"] = statements(result["summary"], result["runs"])
                sink(result)
        del model, ctx
    result["wall_seconds"] = round(time.time() - started, 1)
    result["summary"] = summarise(result)
    result["statements"] = statements(result["summary"], result["runs"])
    result["complete"] = True
    sink(result)
    return result


def _one_run(kind, algorithm, defence, model, shards, build, evaluate, config, device, tick, ctx, names, null_rows):
    log = federate(model, defence, shards, build, evaluate, algorithm, config, device, tick)
    attacks = privacy.attack_run(ctx, defence, algorithm, log.captures, log.models, names, null_rows)
    eps = [r["epsilon"] for r in log.reports if "epsilon" in r]
    return {
        "model": kind,
        "algorithm": algorithm.value,
        "defence": defence,
        "metric": metric_of(kind),
        "curve": log.curve,
        "final": log.curve[-1],
        "steps": log.steps,
        "silenced_steps": log.silenced_steps,
        "silenced_step_share": log.silenced_steps / max(1, log.steps),
        "exports": log.exports,
        "silenced_exports": log.silenced_exports,
        "silenced_export_share": log.silenced_exports / max(1, log.exports),
        "epsilon": max(eps) if eps else None,
        "delta": next((r["delta"] for r in log.reports if "delta" in r), None),
        "attacks": attacks,
        "train_seconds": round(log.train_seconds, 2),
        "seconds_per_round": round(log.train_seconds / config.rounds, 3),
    }
