"""The audit's typed records: what each stage produces and what ``report.json`` holds.

federate (one :class:`UtilityRecord` and one :class:`RoundsRecord` per model x defence) -> attack ->
score (one :class:`AttackRecord` per model x defence x attack, with the attack's null baseline computed
before any defence ran) -> :class:`Verdict` per model x defence. ``AuditReport.to_json()`` is the
``report.json`` schema (README "The audit").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..attacks.registry import ATTACKS as REGISTERED
from ..config import Promise, Threat
from ..harness.output import clean

# An attack "leaks" when its score exceeds its null baseline by more than MARGIN (and the floor): the
# paper's 0.05 bar for ROUGE-1, and "chance + 0.05" for the 1-of-N and label attacks (issues 13, 14).
MARGIN = 0.05
FLOOR = 0.05
# A 1-of-N attack rests on few trials: above the bar, it leaks only when the truth's ranks are also
# unlikely under chance (rank-sum p-value, Bonferroni over the scoring variants, below ALPHA); above the
# bar without that evidence it is "suspect" (rerun with more trials). The label attack is held to the same
# rule with a permutation p-value against its own guesses' chance level (Bonferroni over batch sizes).
ALPHA = 0.01

# The threat each attack measures: a preset's promise is broken by a leak of an attack on a threat it stops.
THREATS = {a.name: Threat(a.threat) for a in REGISTERED}


def rank_sum_p(ranks: list[float], n: int) -> float:
    """P(a sum of len(ranks) uniform ranks on 1..n is <= the observed sum): small when the truth ranks high."""
    if not ranks:
        return 1.0
    dist = [1.0]  # dist[s] = P(sum of ranks so far = s), ranks shifted to 0..n-1
    for _ in ranks:
        new = [0.0] * (len(dist) + n - 1)
        for s, p in enumerate(dist):
            if p:
                for r in range(n):
                    new[s + r] += p / n
        dist = new
    observed = math.ceil(sum(ranks) - len(ranks) - 1e-9)
    return min(1.0, sum(dist[: max(0, observed) + 1]))


@dataclass(frozen=True)
class NullBaseline:
    """What an attack scores on a gradient that holds no information about the batch (text attacks: a
    Gaussian gradient of matched per-tensor norms; 1-of-N and label attacks: chance)."""

    model: str
    attack: str
    score: float  # on the attack's headline metric
    token_recall: float | None = None  # text attacks: the null's token recall (the bag-of-words axis)
    how: str = ""


@dataclass(frozen=True)
class AttackRecord:
    """One attack against one defence on one model, averaged over the gradients it read."""

    model: str
    defence: str
    attack: str
    metric: str  # the headline metric: "rouge1" (text attacks) or "accuracy" (label, fingerprint)
    score: float
    null: float  # the same metric on the null baseline
    gradients: int  # shared gradients (or trials) attacked
    seconds: float
    rouge1: float | None = None
    rouge2: float | None = None
    rougeL: float | None = None
    token_recall: float | None = None
    exact_rate: float | None = None
    null_token_recall: float | None = None
    candidates: int | None = None  # 1-of-N attacks: N
    variants: dict[str, float] = field(default_factory=dict)  # fingerprint: accuracy per scoring variant
    note: str = ""
    exposures: int = 1  # K: exports of one batch the attack read together; 1 = a single export
    refused_after: int | None = None  # the shield refused export K + 1 of the same batch (exposure budget)
    ranks: list[float] = field(default_factory=list)  # 1-of-N: the truth's rank per trial (best variant)
    p_value: float | None = None  # rank-sum (1-of-N) or permutation (labels) p-value, Bonferroni over the variants
    # False when the attack had nothing to read (e.g. no reply carried a loss): the score is then the null by
    # construction, not a measurement, and the row never counts as a leak
    applicable: bool = True
    # True when the score bounds the attack from above (the defence was approximated in the attacker's favour):
    # above the bar such a row is suspect, never a leak
    upper_bound: bool = False

    @property
    def privacy(self) -> float:
        """The worst of ROUGE-1 and token recall (text attacks); the score otherwise."""
        if self.metric == "rouge1":
            return max(self.rouge1 or 0.0, self.token_recall or 0.0)
        return self.score

    @property
    def excess(self) -> float:
        """How far the attack gets beyond its null baseline, on its worst axis."""
        gaps = [self.score - max(FLOOR if self.metric == "rouge1" else 0.0, self.null)]
        if self.token_recall is not None:
            gaps.append(self.token_recall - max(FLOOR, self.null_token_recall or 0.0))
        return max(gaps)

    @property
    def above_bar(self) -> bool:
        return self.applicable and self.excess > MARGIN

    @property
    def leaks(self) -> bool:
        """Above the bar, and (1-of-N attacks) the truth's ranks unlikely under chance."""
        return self.above_bar and not self.upper_bound and (self.p_value is None or self.p_value < ALPHA)

    @property
    def suspect(self) -> bool:
        """Above the bar on too few trials to tell from chance, or on an upper bound of the attack."""
        return self.above_bar and not self.leaks

    def headline(self) -> str:
        """'dager ROUGE-1 0.98 (null 0.12)' — the axis that leaks most."""
        if not self.applicable:
            return f"{self.attack}: nothing to read"
        at = f" at K = {self.exposures}" if self.exposures > 1 else ""
        if self.p_value is not None:
            at += f", p {self.p_value:.2g} over {self.gradients} trials"
        if self.metric == "rouge1" and self.token_recall is not None:
            recall_gap = self.token_recall - max(FLOOR, self.null_token_recall or 0.0)
            rouge_gap = self.score - max(FLOOR, self.null)
            if recall_gap > rouge_gap:
                return (
                    f"{self.attack} token recall {self.token_recall:.2f} (null {self.null_token_recall or 0.0:.2f}){at}"
                )
            return f"{self.attack} ROUGE-1 {self.score:.2f} (null {self.null:.2f}){at}"
        return f"{self.attack} accuracy {self.score:.2f} (chance {self.null:.3f}){at}"


@dataclass(frozen=True)
class UtilityRecord:
    """The global model after the last round, and before round 1 (the untrained reference)."""

    model: str
    defence: str
    rounds: int
    metric: str  # "perplexity" (decoder) or "accuracy" (encoder)
    value: float
    val_loss: float
    before: float  # the same metric before round 1
    f1: float | None = None  # encoder: macro-F1
    chance: float | None = None  # encoder: accuracy of always predicting the commonest validation class
    epsilon: float | None = None  # DP-SGD: Opacus's RDP accountant, at delta
    delta: float | None = None


@dataclass(frozen=True)
class RoundsRecord:
    """FedSGD's per-round counts and the server's held-out metrics after each round."""

    model: str
    defence: str
    rounds: list[dict[str, float]]


@dataclass(frozen=True)
class Reconstruction:
    """A private sentence beside what an attack made of it (first attacked gradient of client 0)."""

    model: str
    defence: str
    attack: str
    reference: str
    prediction: str
    reference_tokens: list[str]
    prediction_tokens: list[str]  # at most MAX_TOKENS; prediction_more says how many were cut
    prediction_more: int = 0


@dataclass(frozen=True)
class Verdict:
    """Per model x defence: does the defence hold against every attack, and if not, which attack reads what."""

    model: str
    defence: str
    holds: bool
    leaking: list[str]  # headlines of the attacks that leak, worst first
    worst: float  # the worst of ROUGE-1 and token recall over the text attacks (the plot's privacy axis)
    calibration: str | None = None  # AEGIS: "public" or "batch"
    exposures: int = 1  # K: the most exports of one batch any attack read together
    refused_after: int | None = None  # the shield refused export K + 1 of one batch
    suspect: list[str] = field(default_factory=list)  # above the bar without the evidence to call it a leak
    promise: str | None = None  # AEGIS presets: what the preset promises, in words (Promise.says)
    # the promise checked against the leaks: True kept, False broken, None not checked (see promise_note)
    promise_kept: bool | None = None
    promise_note: str = ""  # why the promise was not checked (the run lies outside what it is stated for)
    breaking: list[str] = field(default_factory=list)  # the leaks of threats the promise says it stops
    batch_size: int | None = None  # sequences per export in the run the verdict read

    def scope(self) -> str:
        """At what K the verdict was reached."""
        if self.exposures <= 1 and self.refused_after is None:
            return "K = 1 export of each batch"
        refused = f"; export {self.refused_after + 1} refused" if self.refused_after is not None else ""
        return f"K ≤ {self.exposures} export{'s' if self.exposures > 1 else ''} of one batch{refused}"

    def text(self) -> str:
        return self.render()

    def render(self, mark: Callable[[str, str], str] = lambda kind, s: s, esc: Callable[[str], str] = str) -> str:
        """The verdict in words: the promise and whether it was kept, then what held and what leaked.
        ``mark(kind, text)`` styles a word of kind "holds", "leak" or "suspect"; ``esc`` escapes the rest."""
        out = ""
        if self.promise is not None:
            out = esc(self.promise) + " — "
            if self.promise_kept is True:
                out += mark("holds", "promise kept") + esc(f" at batch {self.batch_size}" if self.batch_size else "")
            elif self.promise_kept is False:
                out += mark("leak", "promise broken") + esc(" by " + "; ".join(self.breaking))
            elif self.promise_note:
                out += esc(f"promise not checked ({self.promise_note})")
            else:
                out += esc("promises nothing")
            out += esc(". ")
        if self.holds:
            out += mark("holds", "holds") + esc(f" ({self.scope()})")
            if self.suspect:
                out += esc("; ") + mark("suspect", "suspect") + esc(": " + "; ".join(self.suspect))
            return out
        allowed = self.promise_kept is True
        return out + mark("leak", "leaks") + esc(": " + "; ".join(self.leaking) + (", as stated" if allowed else ""))


def verdicts(
    results: list[AttackRecord],
    model: str,
    defence: str,
    calibration: str | None = None,
    promise: Promise | None = None,
    batch_size: int | None = None,
) -> Verdict:
    """The verdict of one defence on one model; with ``promise`` (an AEGIS preset's), checked against it:
    broken when an attack on a threat it stops leaks, at a batch size it is stated for."""
    rows = [r for r in results if r.model == model and r.defence == defence]
    leaking = sorted((r for r in rows if r.leaks), key=lambda r: -r.excess)
    kept, note, breaking = None, "", []
    if promise is not None and promise.stops:
        note = (promise.outside(batch_size) if batch_size is not None else None) or ""
        if not note:
            breaking = [r.headline() for r in leaking if THREATS.get(r.attack) in promise.stops]
            kept = not breaking
    text = [r.privacy for r in rows if r.metric == "rouge1"]
    k = max((r.exposures for r in rows), default=1)
    refused = [r.refused_after for r in rows if r.exposures == k and r.refused_after is not None]
    suspect = [r.headline() for r in sorted((r for r in rows if r.suspect), key=lambda r: -r.excess)]
    return Verdict(
        model,
        defence,
        not leaking,
        [r.headline() for r in leaking],
        max(text) if text else float("nan"),
        calibration,
        k,
        refused[0] if refused else None,
        suspect,
        None if promise is None else promise.says,
        kept,
        note,
        breaking,
        batch_size,
    )


@dataclass
class AuditReport:
    """Everything the audit produced so far (it grows defence by defence; ``complete`` at the end)."""

    meta: dict[str, Any]
    nulls: list[NullBaseline] = field(default_factory=list)
    results: list[AttackRecord] = field(default_factory=list)
    utility: list[UtilityRecord] = field(default_factory=list)
    rounds: list[RoundsRecord] = field(default_factory=list)
    reconstructions: list[Reconstruction] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    complete: bool = False

    def models(self) -> list[str]:
        return list(dict.fromkeys(u.model for u in self.utility))

    def utility_of(self, model: str, defence: str) -> UtilityRecord | None:
        return next((u for u in self.utility if (u.model, u.defence) == (model, defence)), None)

    def to_json(self) -> dict[str, Any]:
        def rows(items):
            out = []
            for item in items:
                row = asdict(item)
                if isinstance(item, AttackRecord):
                    row["leaks"] = item.leaks
                    row["suspect"] = item.suspect
                    row["privacy"] = item.privacy
                if isinstance(item, Verdict):
                    row["text"] = item.text()
                out.append(row)
            return out

        return clean(
            {
                "complete": self.complete,
                "meta": self.meta,
                "verdicts": rows(self.verdicts),
                "results": rows(self.results),
                "nulls": rows(self.nulls),
                "utility": rows(self.utility),
                "rounds": rows(self.rounds),
                "reconstructions": rows(self.reconstructions),
            }
        )


def report_from_json(data: dict[str, Any]) -> AuditReport:
    """An :class:`AuditReport` back from ``report.json`` (e.g. to redraw the plot or the HTML)."""
    from dataclasses import fields as _fields

    def rows(cls, items):
        names = {f.name for f in _fields(cls)}
        return [cls(**{k: v for k, v in item.items() if k in names}) for item in items or []]

    return AuditReport(
        data.get("meta", {}),
        rows(NullBaseline, data.get("nulls")),
        rows(AttackRecord, data.get("results")),
        rows(UtilityRecord, data.get("utility")),
        rows(RoundsRecord, data.get("rounds")),
        rows(Reconstruction, data.get("reconstructions")),
        rows(Verdict, data.get("verdicts")),
        bool(data.get("complete")),
    )
