"""The utility study's HTML page: the bar's verdict in plain words, the learning curves, the frontier,
the final numbers per run and every attack at every attacked round (styles shared with the audit page)."""

from __future__ import annotations

import math

from ..harness.style import CSS as _CSS
from ..harness.style import escape as _e
from ..harness.style import number_cell as _num
from .config import CHACHA
from .results import BEFORE


def _ratio(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "<td class='n na'>–</td>"
    return f"<td class='n'>{value:.3f}x</td>"


def _yes(flag: bool) -> str:
    return "<span class='holds'>yes</span>" if flag else "<span class='leak'>no</span>"


def _settings(result: dict) -> str:
    s, m = result["settings"], result.get("machine", {})
    rounds = ", ".join(map(str, result["attacked_rounds"]))
    where = m.get("card") or f"CPU ({m.get('cpu_cores')} cores, {m.get('threads')} torch threads)"
    return (
        f"<p>{s['clients']} clients (Dirichlet split of the topics, alpha {s['dirichlet_alpha']}), {s['rounds']} "
        f"rounds, batch {s['batch_size']}, {_algorithms(s)}, {_e(s['optimizer'])} at peak lr "
        f"{s['lr']:g} (warmup {s['warmup']:.0%} of the rounds, cosine to {s['min_lr_share']:g}x), evaluation every "
        f"{s['eval_every']} rounds on {result['data']['validation_used']} held-out sentences never trained on; "
        f"{_attacked(s, rounds)} "
        f"Machine: {_e(where)}, torch {_e(m.get('torch', ''))}.{_noise(m)} "
        f"Wall time {result.get('wall_seconds', 0):.0f} s."
        f"{'' if result.get('complete') else ' <b>Incomplete run</b>: the rows below finished.'}</p>"
    )


def _algorithms(s: dict) -> str:
    """The algorithms this study ran: FedSGD (one step per round) and / or FedAvg with its local steps."""
    e = "one local epoch" if not s.get("local_steps") else f"E = {s['local_steps']} local steps"
    names = {"fedsgd": "FedSGD (one step per round)", "fedavg": f"FedAvg with {e} per round"}
    return " and ".join(names[a] for a in s.get("algorithms", ("fedsgd", "fedavg")))


def _attacked(s: dict, rounds: str) -> str:
    if s.get("attacks") == []:  # --attacks '': a utility-only study
        return "no attacks run."
    return f"attacks on {min(s['attack_clients'], s['clients'])} client(s)' exports at rounds {rounds}."


def _exposure(result: dict) -> str:
    """What AEGIS's exposure budget did in this study, and (budget off) why its numbers are no privacy claim."""
    if result["settings"].get("exposure", BEFORE["exposure"]) == "off":
        return (
            "<b>Exposure budget OFF: a measurement of the noise alone, not a private setting.</b> Every AEGIS "
            "export carries its batch, however often the example was exported before; each repeat averages the "
            "noise down, so past one exposure per example the preset's promise no longer holds and the attack "
            "rows (where run) understate what a server averaging the repeats could read. The run shows what the "
            "presets' signal-to-noise caps alone cost in utility."
        )
    return (
        "AEGIS keeps its exposure budget: a step whose batch holds an example already exported the budgeted "
        "number of times is <i>silenced</i> (pure noise leaves, nothing is learnt); the share of silenced exports "
        "is shown per run."
    )


def _noise(machine: dict) -> str:
    """The CPU flood's normals, when they are not the shipped cipher (a benchmark's --fast-noise)."""
    source = machine.get("cpu_noise")
    return "" if source in (None, CHACHA) else f" CPU flood normals: {_e(source)} (not the ChaCha stream)."


def _note(a: dict) -> str:
    note = a.get("note", "")
    if a.get("p_value") is not None:
        note = f"p {a['p_value']:.2g} over {a['gradients']} trials" + ("; " + note if note else "")
    return note


def utility_html(result: dict, curves: str | None, frontier: str | None) -> str:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>AEGIS utility</title><style>{_CSS}</style>"
        "</head><body><h1>AEGIS utility: long federated runs</h1>",
        "<div class='how'><b>How to read this.</b> Every defence trains the same model from the same start on "
        "the same non-identical client data; the curves are the global model on held-out sentences. A defence "
        "meets the bar when its final validation perplexity is at most 1.05x the undefended run's (accuracy at "
        "least 0.98x for the classifier) <i>and</i> every attack stays within max(0.05, null + 0.05) at every "
        f"attacked round. {_exposure(result)} DP-SGD's ε is Opacus's RDP accountant at δ, sampling rate 1; "
        "an AEGIS preset's is its exposure budget's exports composed at the noise multiplier of one export "
        "(aegis.accounting; ∞ with the budget off or a tensor exported clean).</div>",
        _settings(result),
        "<h2>The bar</h2><ul>",
        *(f"<li>{_e(line)}</li>" for line in result.get("statements", [])),
        "</ul>",
    ]
    for name, alt in ((curves, "learning curves"), (frontier, "privacy-utility frontier")):
        if name:
            parts.append(f"<img src='{_e(name)}' alt='{alt}' style='max-width:100%'>")
    parts.append(
        "<h2>Final numbers</h2><table><tr><th>model</th><th>algorithm</th><th>defence</th><th>final</th>"
        "<th>undefended</th><th>untrained</th><th>vs undefended</th><th>utility bar</th><th>worst attack</th>"
        "<th>excess over null</th><th>privacy bar</th><th>silenced exports</th><th>DP ε</th><th>s / round</th></tr>"
    )
    seconds = {(r["model"], r["algorithm"], r["defence"]): r.get("seconds_per_round") for r in result["runs"]}
    for s in result.get("summary", []):
        eps = "–" if s["epsilon"] is None else f"{s['epsilon']:.3g}"
        parts.append(
            f"<tr><td>{_e(s['model'])}</td><td>{_e(s['algorithm'])}</td><td>{_e(s['defence'])}</td>"
            f"{_num(s['final'], 2)}{_num(s['undefended'], 2)}{_num(s['untrained'], 2)}{_ratio(s['ratio'])}"
            f"<td>{_yes(s['meets_utility'])}</td><td>{_e(s['worst_attack'] or '–')}</td>{_num(s['worst_excess'])}"
            f"<td>{_yes(s['meets_privacy'])}</td><td class='n'>{s['silenced_export_share']:.0%}</td>"
            f"<td class='n'>{eps}</td>{_num(seconds.get((s['model'], s['algorithm'], s['defence'])), 2)}</tr>"
        )
    parts.append(
        "</table><h2>Attacks</h2><table><tr><th>model</th><th>algorithm</th><th>defence</th><th>attack</th>"
        "<th>round</th><th>score</th><th>null</th><th>token recall</th><th>excess</th><th>notes</th></tr>"
    )
    for run in result["runs"]:
        for a in run.get("attacks", []):
            head = f"<tr><td>{_e(run['model'])}</td><td>{_e(run['algorithm'])}</td><td>{_e(run['defence'])}</td>"
            if "skipped" in a:
                parts.append(f"{head}<td>{_e(a['attack'])}</td><td colspan='6' class='na'>{_e(a['skipped'])}</td></tr>")
                continue
            cls = "leak" if a["above_bar"] else "holds"
            parts.append(
                f"{head}<td>{_e(a['attack'])}</td><td class='n'>{a['round']}</td>"
                f"<td class='n'><span class='{cls}'>{a['score']:.3f}</span></td>{_num(a['null'])}"
                f"{_num(a.get('token_recall'))}{_num(a['excess'])}<td>{_e(_note(a))}</td></tr>"
            )
    parts.append("</table></body></html>")
    return "\n".join(parts)
