"""The attack leg of ``frontier_delta.py``: every attack of the suite on ONE client's round delta, beside its
positive control and its null.

Attention LoRA (q/k/v, an explicit opt-in): DAGER on one client's clean delta at D = 8 (one SGD step, the
adapters at a later round's state: B non-zero) at each rank of ``--attn-ranks``; the stacked factors span at
most 3 r inputs, so a rank whose 3 r is below the round's tokens reads at its null and rank 256 is the
positive control.

Per D: the client's delta under each variant (full MLP with AdamW and with SGD, LoRA r on the MLP with AdamW)
at each attacked S, the clean deltas (S = inf) as positive controls (the full-MLP one at D = 8 must leak for
a null elsewhere to mean anything; one SGD step on it is the gradient itself up to fp32 rounding, ``sgd`` in
the row), and for each the null: the same attack on a random tensor of the delta's per-tensor norms. The span
attacks read a LoRA delta through its A factors (``aegis.delta_attacks.span_view``); TAG reads ``-delta / lr``.
Candidate verification: 1-of-N client datasets (the client's first sentence replaced by "my pin is ____"), the
attacker re-trains every candidate from the same snapshot with the same seed and picks the likeliest under
the public noise level; null 1/N.
"""
from __future__ import annotations

import contextlib
import copy
import math
import signal
import time
import traceback

import torch

from aegis.attacks import dager, embedding_norm, mlp_span, spectral, tag
from aegis.attacks.embedding_projection import embedding_projection
from aegis.config import FROZEN, ROLES, AegisConfig, ExportMode, Treatment
from aegis.delta import DeltaShield, PublicBatches
from aegis.delta_attacks import attacker_model, pseudo_gradient, span_view
from aegis.exposure import ExposurePolicy
from aegis.metrics import null_gradient, token_recall

SPAN_ATTACKS = {"dager": dager, "mlp_span": mlp_span, "spectral": spectral, "embedding_norm": embedding_norm,
                "embedding_projection": embedding_projection}
PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(1000)]


def noisy(clipped: dict, sigmas: dict, gen: torch.Generator, scale: float = 1.0) -> dict:
    """``clipped + sigma Z`` per tensor (sigma / sqrt(N) for a mean of N: ``scale``)."""
    out = {}
    for n, d in clipped.items():
        s = sigmas.get(n, 0.0) * scale
        out[n] = d if s == 0 else d + s * torch.randn(d.shape, generator=gen, device=d.device, dtype=d.dtype)
    return out


def run_attack(name, model, grads, tok, texts, args, public=None):
    b = len(texts)
    if name == "tag":
        return tag(model, grads, tok, b, steps=args.tag_steps, seq_len=args.tag_len)
    kw = {"public": public} if name == "spectral" and public else {}
    return SPAN_ATTACKS[name](model, grads, tok, b, **kw)


class Capped(Exception):
    """An attack (with its null) ran past ``--attack-cap`` seconds."""


@contextlib.contextmanager
def capped(seconds: float):
    """Raise :class:`Capped` in the main thread after ``seconds`` (0: no cap)."""
    def stop(*_):
        raise Capped

    if not seconds:
        yield
        return
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def attack_cell(bench, cell: dict, texts: list[str], save) -> None:
    """Every attack on ``cell['grads']`` and its null, each recorded (or its error) as it finishes."""
    results = cell["row"].setdefault("attacks", {})
    for name in bench.args.attacks:
        if name == "verification" or name in results:
            continue
        if bench.out_of_time():
            results[name] = {"skipped": "time budget"}
            continue
        t0 = time.perf_counter()
        try:
            model, grads = cell["model"], cell["grads"]
            if name == "tag":
                model, grads = cell["tag_model"], cell["tag_grads"]
            with capped(bench.args.attack_cap):
                preds = run_attack(name, model, grads, bench.tok, texts, bench.args, cell.get("public"))
                nulls = run_attack(name, model, null_gradient(grads, bench.args.seed), bench.tok, texts, bench.args,
                                   cell.get("public"))
            results[name] = {"predictions": preds, "null_predictions": nulls,
                             "token_recall": token_recall(preds, texts, bench.tok),
                             "null_token_recall": token_recall(nulls, texts, bench.tok),
                             "seconds": round(time.perf_counter() - t0, 1)}
        except Capped:
            results[name] = {"timed_out_s": bench.args.attack_cap, "note": "not measured: over --attack-cap"}
        except Exception as err:  # one failing attack must not end the run
            results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
        save()


def verification(bench, variant: str, texts: list[str], s_values, save, row: dict) -> None:
    """1-of-N candidate datasets (module docstring): accuracy per S over ``--trials`` noise draws."""
    n, trials = bench.args.candidates, bench.args.trials
    t0 = time.perf_counter()
    candidates = [[f"my pin is {pin}", *texts[1:]] for pin in PINS[:n]]
    clipped, sigmas_of = [], None
    for cand in candidates:
        out = bench.client_delta(variant, cand, epochs=1)
        clipped.append(out["clipped"])
        sigmas_of = out["sigma"]
    assert sigmas_of is not None
    gen = torch.Generator(device=bench.device).manual_seed(bench.args.seed + 17)
    result = {}
    for s in s_values:
        sigmas = sigmas_of(s)
        if not all(v > 0 for v in sigmas.values()):
            result[str(s)] = {"score": 1.0, "null": 1 / n, "note": "no noise: the exact delta identifies the truth"}
            continue
        right = 0
        for t in range(trials):
            truth = (t * 7919) % n
            obs = noisy(clipped[truth], sigmas, gen)
            scores = [sum(float((obs[k] - c[k]).double().square().sum()) / sigmas[k] ** 2 for k in obs)
                      for c in clipped]
            right += int(min(range(n), key=scores.__getitem__) == truth)
        result[str(s)] = {"score": right / trials, "null": 1 / n}
    row["verification"] = {"by_S": result, "candidates": n, "trials": trials,
                           "seconds": round(time.perf_counter() - t0, 1)}
    save()


def attack_cells(args) -> list[tuple[int, str, float, str]]:
    """(D, variant, S, optimizer) in priority order (a run cut short keeps the first): per D, the positive
    controls, then at every attacked S the LoRA and full-MLP AdamW deltas and the full-MLP SGD delta (at D = B
    one SGD step: the flooded gradient itself, the worst case)."""
    cells = []
    for d in args.attack_d:
        if not args.skip_controls:
            cells += [(d, "full-mlp", math.inf, "adamw"), (d, "full-mlp", math.inf, "sgd"),
                      (d, "lora-mlp", math.inf, "adamw")]
        flooded = [("lora-mlp", "adamw"), ("full-mlp", "adamw"), ("full-mlp", "sgd")]  # sgd: one step is the gradient
        cells += [(d, v, s, opt) for s in args.attack_s for v, opt in flooded]
    return cells


def attack_leg(bench, save) -> None:
    """Every cell of :func:`attack_cells`: the client's delta, each attack beside its null."""
    args = bench.args
    for d, variant, s, optimizer in attack_cells(args):
        texts = bench.clients(d, 1)[0]
        row = {"leg": "attack", "D": d, "variant": variant, "S": s, "optimizer": optimizer, "E": 1,
               "references": texts}
        earlier = bench.earlier.get((d, variant, s, optimizer), {})  # --keep: what this run does not redo
        row["attacks"] = {k: v for k, v in earlier.get("attacks", {}).items() if k not in args.attacks}
        if "verification" in earlier and "verification" not in args.attacks:
            row["verification"] = earlier["verification"]
        bench.rows.append(row)
        if bench.out_of_time():
            row["skipped"] = "time budget"
            save()
            continue
        try:
            out = bench.client_delta(variant, texts, epochs=1, optimizer=optimizer)
            sigmas = out["sigma"](s)
            gen = torch.Generator(device=bench.device).manual_seed(args.seed + d)
            export = noisy(out["clipped"], sigmas, gen)
            lr = bench.lr(variant, optimizer)
            view = span_view(export)
            public = {n2: (1.0, sigmas[n1], 0.0, 0.0) for n1, n2 in zip(export, _plain(export)) if n1 in sigmas}
            cell = {"row": row, "model": bench.base, "grads": view, "public": public if math.isfinite(s) else None,
                    "tag_model": out["model"], "tag_grads": pseudo_gradient(export, lr)}
            attack_cell(bench, cell, texts, save)
            if "verification" in args.attacks and optimizer == "adamw" and not math.isfinite(s) and d == min(
                    args.attack_d):
                verification(bench, variant, texts, [math.inf, *args.s], save, row)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
            row["trace"] = traceback.format_exc()[-1500:]
        save()


def _plain(delta: dict) -> list[str]:
    """The attacked names of ``span_view`` in the order of ``delta`` (LoRA B factors map to themselves)."""
    out = []
    for name in delta:
        view = span_view({name: delta[name]})
        out.append(next(iter(view)) if view else name)
    return out


def attention_lora_leg(bench, save) -> None:
    """DAGER on attention-LoRA deltas, one row per rank (module docstring)."""
    import peft

    args = bench.args
    texts = bench.clients(args.attn_d, 1)[0]
    tokens = sum(len(ids) for ids in bench.tok(texts, truncation=True, max_length=args.tokens)["input_ids"])
    for rank in args.attn_ranks:
        row = {"leg": "attention-lora", "rank": rank, "D": args.attn_d, "tokens": tokens, "optimizer": "sgd",
               "lr": args.sgd_lr, "references": texts}
        bench.rows.append(row)
        if bench.out_of_time():
            row["skipped"] = "time budget"
            save()
            continue
        t0 = time.perf_counter()
        try:
            model = peft.get_peft_model(copy.deepcopy(bench.base), peft.LoraConfig(
                r=rank, lora_alpha=rank, target_modules=["q_proj", "k_proj", "v_proj"]))
            gen = torch.Generator().manual_seed(rank)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".lora_B." in name:
                        p.copy_(torch.randn(p.shape, generator=gen).to(p.device) * 0.02)
            server = attacker_model(model)
            opened = Treatment("matrix", rho=1.0, clip=1e6)
            config = AegisConfig(preset=dict.fromkeys(ROLES, FROZEN) | {"attention_lora": opened},
                                 export=ExportMode.DELTA, exposure=ExposurePolicy.OFF)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.sgd_lr)
            shield = DeltaShield(model, opt, config, PublicBatches(model, bench.tok, bench.public, args.batch,
                                                                   args.tokens))
            with shield.round() as rnd:
                bench._train(model, opt, texts, 1, args.seed)
            view = span_view(rnd.delta)
            preds = dager(server, view, bench.tok, len(texts))
            nulls = dager(server, null_gradient(view, args.seed), bench.tok, len(texts))
            row.update(predictions=preds, null_predictions=nulls, token_recall=token_recall(preds, texts, bench.tok),
                       null_token_recall=token_recall(nulls, texts, bench.tok))
        except Exception as err:  # one failing cell must not end the run
            row["error"] = f"{type(err).__name__}: {err}"
            row["trace"] = traceback.format_exc()[-1500:]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        save()
