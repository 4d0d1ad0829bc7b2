"""The result file: the bar every defence is held to, merging runs of several invocations (``--append``),
and atomic writes.

The bar (issue 16): final validation perplexity <= 1.05x undefended (decoder), accuracy >= 0.98x
undefended (encoder), and every attack <= max(0.05, null + 0.05) at every attacked round."""

from __future__ import annotations

import math
from collections.abc import Sequence

PPL_BAR = 1.05
ACC_BAR = 0.98
# settings that must agree for runs of two invocations to share one curve plot
SAME = ("clients", "rounds", "batch_size", "local_steps", "optimizer", "lr", "warmup", "min_lr_share",
        "dirichlet_alpha", "seed", "max_eval", "exposure")
# what a setting meant in result files written before it existed
BEFORE = {"exposure": "silence"}


def _value(run: dict) -> float:
    value = run["final"].get(run["metric"])
    return float("nan") if value is None else float(value)


def summarise(result: dict) -> list[dict]:
    """Per model x algorithm x defence: final utility against undefended and untrained, the worst attack
    (its excess over max(FLOOR, null)), and whether the run meets the utility bar, the privacy bar, both."""
    untrained = {r["model"]: r["untrained"][r["metric"]] for r in result.get("references", [])}
    rows = []
    for run in result.get("runs", []):
        if "error" in run:
            continue
        here = (run["model"], run["algorithm"], "none")
        none = next(
            (r for r in result["runs"] if (r["model"], r["algorithm"], r["defence"]) == here and "error" not in r), None
        )
        value, ref = _value(run), _value(none) if none else float("nan")
        if run["metric"] == "perplexity":
            ratio = value / ref if ref > 0 else float("nan")
            meets_utility = ratio <= PPL_BAR
        else:
            ratio = value / ref if ref > 0 else float("nan")
            meets_utility = ratio >= ACC_BAR
        scored = [a for a in run["attacks"] if "skipped" not in a]
        worst = max(scored, key=lambda a: a["excess"], default=None)
        rows.append(
            {
                "model": run["model"],
                "algorithm": run["algorithm"],
                "defence": run["defence"],
                "metric": run["metric"],
                "final": value,
                "undefended": ref,
                "untrained": untrained.get(run["model"]),
                "ratio": ratio,
                "meets_utility": bool(meets_utility) if math.isfinite(ratio) else False,
                "worst_attack": None if worst is None else f"{worst['attack']} round {worst['round']}",
                "worst_excess": None if worst is None else worst["excess"],
                "worst_score": None if worst is None else worst["privacy"],
                # 1-of-N attacks rest on few trials: the rank-sum p-value says whether the excess is chance
                "worst_p_value": None if worst is None else worst.get("p_value"),
                "significant_leak": any(a["leaks"] for a in scored),
                "attacks_scored": len(scored),
                "meets_privacy": bool(scored) and not any(a["above_bar"] for a in scored),
                "silenced_export_share": run["silenced_export_share"],
                "epsilon": run["epsilon"],
            }
        )
        rows[-1]["meets_both"] = rows[-1]["meets_utility"] and rows[-1]["meets_privacy"]
    return rows


def merge(old: dict, new: dict) -> dict:
    """``new``'s runs replace ``old``'s of the same model x algorithm x defence; the rest are kept. Runs of
    different settings do not mix (one curve plot, one bar)."""
    setting = lambda s, k: s.get(k, BEFORE.get(k))  # noqa: E731
    differ = [k for k in SAME if setting(old["settings"], k) != setting(new["settings"], k)]
    if differ:
        raise ValueError(
            f"--append: the existing result was run with other settings ({', '.join(differ)}): use the same "
            "settings or another --out folder"
        )
    key = lambda r: (r["model"], r["algorithm"], r["defence"])  # noqa: E731
    fresh = {key(r) for r in new["runs"]}
    models = {r["model"] for r in new["references"]}
    out = dict(new)
    out["runs"] = [r for r in old["runs"] if key(r) not in fresh] + new["runs"]
    out["references"] = [r for r in old["references"] if r["model"] not in models] + new["references"]
    out["nulls"] = [r for r in old["nulls"] if r["model"] not in models] + new["nulls"]
    out["machines"] = old.get("machines", [old.get("machine")]) + [new["machine"]]
    out["wall_seconds"] = round(float(old.get("wall_seconds", 0)) + float(new.get("wall_seconds", 0)), 1)
    out["settings"] = {**new["settings"], "defences": sorted({r["defence"] for r in out["runs"]}),
                       "models": sorted({r["model"] for r in out["runs"]}),
                       "algorithms": sorted({r["algorithm"] for r in out["runs"]})}
    return refresh(out)


def refresh(result: dict) -> dict:
    """Recompute the bar per run and its sentences from the runs (after a merge, or with newer rules)."""
    result["summary"] = summarise(result)
    result["statements"] = statements(result["summary"], result["runs"])
    return result


def statements(summary: list[dict], runs: Sequence[dict] = ()) -> list[str]:
    """One plain sentence per model x algorithm: which defences meet the bar (utility and privacy) and which
    do not, and why; then one per run that failed."""
    out = []
    for model, algorithm in dict.fromkeys((s["model"], s["algorithm"]) for s in summary):
        rows = [s for s in summary if (s["model"], s["algorithm"]) == (model, algorithm) and s["defence"] != "none"]
        both = [s["defence"] for s in rows if s["meets_both"]]
        misses = []
        for s in rows:
            if s["meets_both"]:
                continue
            why = []
            if not s["meets_utility"]:
                why.append(f"utility {s['ratio']:.3g}x undefended" if s["ratio"] is not None else "no utility")
            if not s["meets_privacy"]:
                p = f", p {s['worst_p_value']:.2g}" if s.get("worst_p_value") is not None else ""
                why.append(f"{s['worst_attack']} {s['worst_excess']:+.2f} over null{p}" if s["worst_attack"]
                           else "no attack scored")
            misses.append(f"{s['defence']} ({'; '.join(why)})")
        decoder = bool(rows) and rows[0]["metric"] == "perplexity"
        bar = f"ppl <= {PPL_BAR}x undefended" if decoder else f"acc >= {ACC_BAR}x undefended"
        out.append(
            f"{model} · {algorithm} (bar: {bar}, every attack <= max(0.05, null + 0.05)): meets it: "
            f"{', '.join(both) or 'none'}; does not: {', '.join(misses) or 'none'}"
        )
    for run in runs:
        if "error" in run:
            out.append(f"{run['model']} · {run['algorithm']} · {run['defence']}: the run failed ({run['error'][:300]})")
    return out
