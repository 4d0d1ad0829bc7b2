"""The attacks and the report of ``clients_curve_delta.py``: each client's clip, candidate verification on a
round's sum (worst case: the target's clipped delta plus the round's full noise), the bag-of-words attacks,
the summary (ratios, N*) and the plot."""
from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

import aegis_kernels.reference as ref

BAR = 1.25  # N*: best perplexity at most this times undefended FedAvg on the same pools


def clipped_sum(deltas: dict, table) -> tuple[dict, float]:
    """Sum over the stacked clients of ``rho min(1, clip / |delta_c|) delta_c`` per tensor, and the share of
    (client, tensor) pairs whose clip bound."""
    total, bound, count = {}, 0, 0
    for k, (rho, _, clip, _) in table.items():
        d = deltas[k].float()
        norms = d.flatten(1).norm(dim=1)
        scale = rho * ref.clip_scale(norms, torch.tensor(clip, device=d.device))
        total[k] = torch.einsum("c,c...->...", scale, d)
        bound += int((norms > clip).sum())
        count += norms.numel()
    return total, bound / max(count, 1)


def clipped_each(deltas: dict, table, j: int) -> dict:
    out = {}
    for k, (rho, _, clip, _) in table.items():
        d = deltas[k][j].float()
        out[k] = rho * ref.clip_scale(d.norm(), torch.tensor(clip, device=d.device)) * d
    return out


def verify(candidates: list[dict], sigma: dict, trials: int, seed: int, n: int, scales=(1.0,)) -> dict:
    """1-of-n: observe candidate ``truth``'s clipped delta + s sigma Z for each noise scale s, pick the likeliest
    (the smallest whitened distance: |w_j|^2 - 2 <obs, w_j> + const); ``score`` at s = 1."""
    w = torch.stack([torch.cat([c[k].flatten() / sigma[k] for k in sorted(sigma)]) for c in candidates]).double()
    gen = torch.Generator(device=w.device).manual_seed(seed + 17)
    by_scale = {}
    for scale in scales:
        ws = w / scale
        norms, right = ws.pow(2).sum(1), 0
        for start in range(0, trials, 50):
            truths = torch.tensor([(t * 7919) % n for t in range(start, min(trials, start + 50))], device=w.device)
            obs = ws[truths] + torch.randn((len(truths), w.shape[1]), generator=gen, device=w.device, dtype=w.dtype)
            right += int(((norms[None, :] - 2 * obs @ ws.T).argmin(1) == truths).sum())
        by_scale[scale] = right / trials
    off = torch.cdist(w, w)[~torch.eye(n, dtype=torch.bool, device=w.device)]
    return {"score": by_scale.get(1.0, by_scale[scales[0]]), "null": 1 / n, "candidates": n, "trials": trials,
            "by_scale": by_scale, "whitened_distance": {"min": float(off.min()), "median": float(off.median())}}


def bag_of_words(name: str, server, grads: dict, tok, references: list[str], sigma: dict) -> dict:
    from aegis.attacks import spectral
    from aegis.attacks.embedding_projection import embedding_projection
    from aegis.delta_attacks import span_view
    from aegis.metrics import null_gradient, token_recall

    t0 = time.perf_counter()
    try:
        if name == "spectral":
            public = {plain: (1.0, s, 0.0, 0.0) for k, s in sigma.items() for plain in span_view({k: torch.zeros(1)})}
            attack = lambda g: spectral(server, g, tok, len(references), public=public)  # noqa: E731
        elif name == "embedding_projection":
            attack = lambda g: embedding_projection(server, g, tok, len(references))  # noqa: E731
        else:
            raise ValueError(f"unknown attack {name!r}: use verification, spectral, embedding_projection")
        preds, nulls = attack(grads), attack(null_gradient(grads, 0))
        return {"predictions": preds, "token_recall": token_recall(preds, references, tok),
                "null_token_recall": token_recall(nulls, references, tok),
                "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as err:  # one failing attack must not end the run
        return {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}


# -- the grid, the summary, the plot ------------------------------------------------------------------
def attack_header(r: int, target: list[str]) -> dict:
    return {"round": r, "view": "worst case: the target's clipped delta + the round's full noise (every other user "
            "known)", "references": target}


def summarise(result: dict) -> None:
    """Ratios to undefended FedAvg on the same pools, verification at chance, and N*."""
    args = result["args"]
    base = {r["clients"]: r["best"] for r in result["rows"] if r["kind"] == "undefended" and "best" in r}
    passing = []
    for r in result["rows"]:
        if r["kind"] != "defended" or "best" not in r:
            continue
        b = base.get(min(r["clients"], args["pool"]))
        r["ratio"] = None if b is None else r["best"] / b
        v = r.get("attacks", {}).get("verification")
        r["verification_at_chance"] = None if v is None else v["score"] <= v["null"] + 0.05
        eps = r["privacy"]["run"]["epsilon"]
        if r["ratio"] is not None and r["ratio"] <= BAR and eps <= args["epsilon"] * 1.001:
            passing.append(r["clients"])
    n_max = max(args["clients"])
    result["n_star"] = min(passing) if passing else f"not reached up to N = {n_max}"
    star = next((r for r in result["rows"] if passing and r["key"] == f"defended N={min(passing)}"), None)
    result["at_n_star"] = None if star is None else {
        "ratio": star["ratio"], "best": star["best"], "epsilon": star["privacy"]["run"]["epsilon"],
        "epsilon_at_best": star["privacy"]["at_best"]["epsilon"], "verification": star.get("attacks", {}).get(
            "verification", {}).get("score"), "verification_at_chance": star["verification_at_chance"]}


def plot(result: dict, path: Path) -> None:
    """Validation perplexity over rounds; best / undefended against N; verification and epsilon against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, ratio, attack) = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in result["rows"]:
        if "curve" in r:
            xs, ys = zip(*r["curve"])
            curves.plot(xs, ys, ls="--" if r["kind"] == "undefended" else "-", marker=".", label=r["key"])
    curves.set_yscale("log")
    curves.set_xlabel("round")
    curves.set_ylabel("validation perplexity")
    curves.legend(fontsize=7)
    rows = sorted((r for r in result["rows"] if r.get("ratio") is not None), key=lambda r: r["clients"])
    xs = [r["clients"] for r in rows]
    ratio.plot(xs, [r["ratio"] for r in rows], marker="o", color="tab:red")
    for r in rows:
        ratio.annotate(f"eps {r['privacy']['run']['epsilon']:.2g}", (r["clients"], r["ratio"]), fontsize=7)
    ratio.axhline(BAR, color="grey", ls="--", lw=0.8, label=f"{BAR}x undefended")
    ratio.set_ylabel("best perplexity / undefended FedAvg (same pools)")
    with_v = [r for r in rows if r.get("attacks", {}).get("verification")]
    attack.plot([r["clients"] for r in with_v], [r["attacks"]["verification"]["score"] for r in with_v], marker="o",
                label="candidate verification (worst case)")
    if with_v:
        null = with_v[0]["attacks"]["verification"]["null"]
        attack.axhline(null + 0.05, color="grey", ls="--", lw=0.8, label="chance + 0.05")
    attack.set_ylabel("1-of-candidates accuracy on the round's sum")
    for ax in (ratio, attack):
        ax.set_xscale("log")
        ax.set_xlabel("clients per round N")
        ax.legend(fontsize=7)
    a = result["args"]
    fig.suptitle(f"{result['model']} on {result['card']}: secure delta rounds, LoRA r={a['rank']} MLP, "
                 f"D={a['sentences']}, E={a['epochs']}, R={a['rounds']}, pool {a['pool']}, eps {a['epsilon']:g}; "
                 f"N* = {result['n_star']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
