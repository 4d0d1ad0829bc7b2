"""The audit's attacks: each takes the shared gradients the server captured (and, for the secret
completion, what the defence exports for a secret sentence) and returns one :class:`AttackRecord`.

* text attacks (``aegis.attacks``: dager, embedding_norm, mlp_span, spectral, tag): reconstructions
  scored by ROUGE-1/2/L and token recall; null = the same attack on a Gaussian gradient of matched
  per-tensor norms (the clean gradient of client 0's first batch), computed before any defence runs;
* ``labels`` (``aegis.attacks.labels``, encoder): the batch's label multiset from the head gradient, on
  fresh exports at B = 1, 2 and 8 (``aegis.audit.label_attack``); null = the same guesses scored against
  batches they were not made from; leaks only with a permutation p < 0.01 (Bonferroni over the variants);
* ``fingerprint_pool`` (``aegis.attacks.fingerprint``): which of N candidate batches (every client's
  true batch of the round and decoys from the data) each captured gradient came from; null = 1/N;
* ``fingerprint_secret``: "my pin is ____" against N same-format values, each trial one defended step
  of a B = 1 secret sentence; null = 1/N;
* ``loss_oracle`` (``aegis.attacks.loss_oracle``): which of the ``fingerprint_pool`` candidates each reply
  came from, by the distance of the candidate's loss to the loss the reply reported; null = 1/N. A reply
  that carries no loss (AEGIS replies never do) leaves nothing to read: the row says so.

The flood-level attacks rebuild AEGIS's calibration from its public configuration (Kerckhoffs), so
they apply to the AEGIS rows only; a baseline has no flood level to read (its rows say n/a).
Encoder candidates carry their true labels: the attacker is given the labels, an upper bound.
"""

from __future__ import annotations

import functools
import random
import time

from torch import Tensor, nn

from ..attacks.registry import Family, attack, text_attack
from ..data import Example
from ..defence import Aegis
from ..registry import DefenceSpec
from .attack_base import COST, MAX_LENGTH, AuditAttack, ModelContext, Target, server_copy
from .label_attack import LabelAttack
from .loss_attack import LossOracle
from .records import AttackRecord, NullBaseline, Reconstruction, rank_sum_p

MAX_TOKENS = 60  # prediction tokens kept per reconstruction (the rest is counted)
BOUNDED = ("dager", "mlp_span")  # prefix searches whose length limit is otherwise the model's context
SECRET_TEMPLATE = "my pin is {}"


# -- scoring -------------------------------------------------------------------------------------------------------


def token_ids(tokenizer, text: str) -> list[int]:
    """Sub-word ids without specials and without the tokenizer's max-length warning (a reconstruction
    may be a bag of thousands of tokens; nothing is run through the model here)."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def text_scores(predictions: list[str], references: list[str], tokenizer, alignment: str) -> dict[str, float]:
    from .. import metrics

    scores = metrics.rouge(predictions, references, alignment=alignment)
    wanted = {t for ref in references for t in token_ids(tokenizer, ref)}
    got = {t for pred in predictions for t in token_ids(tokenizer, pred)}
    return {
        "rouge1": scores["rouge1"],
        "rouge2": scores["rouge2"],
        "rougeL": scores["rougeL"],
        "token_recall": len(wanted & got) / len(wanted) if wanted else 0.0,
        "exact_rate": metrics.exact_rate(predictions, references),
    }


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = ("rouge1", "rouge2", "rougeL", "token_recall", "exact_rate")
    if not rows:
        return dict.fromkeys(keys, 0.0)
    return {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in keys}


def reconstruction_rows(
    ctx: ModelContext, defence: str, attack: str, refs: list[str], preds: list[str]
) -> list[Reconstruction]:
    from .. import metrics

    rows = []
    tok = ctx.tokenizer
    for ref, j in zip(refs, metrics.align(preds, refs, ctx.alignment)):
        pred = "" if j is None else preds[j]
        ids = token_ids(tok, pred)
        rows.append(
            Reconstruction(
                ctx.kind,
                defence,
                attack,
                ref,
                pred if len(ids) <= MAX_TOKENS else tok.decode(ids[:MAX_TOKENS]),
                tok.convert_ids_to_tokens(token_ids(tok, ref)),
                tok.convert_ids_to_tokens(ids[:MAX_TOKENS]),
                max(0, len(ids) - MAX_TOKENS),
            )
        )
    return rows


# -- the attacks ---------------------------------------------------------------------------------------------------


class TextAttack(AuditAttack):
    def __init__(self, name: str) -> None:
        self.name = name

    def _fn(self):
        fn = text_attack(self.name)
        if self.name in BOUNDED:  # the clients' sentences end by MAX_LENGTH: a longer search finds only noise
            return functools.partial(fn, max_len=MAX_LENGTH)
        return fn

    def null(self, ctx: ModelContext, first: Target) -> NullBaseline:
        from ..metrics import null_gradient

        preds = self._fn()(ctx.model, null_gradient(first.grads), ctx.tokenizer, len(first.references))
        scores = text_scores(preds, first.references, ctx.tokenizer, ctx.alignment)
        return NullBaseline(
            ctx.kind,
            self.name,
            round(scores["rouge1"], 4),
            round(scores["token_recall"], 4),
            "the attack on a Gaussian gradient of matched per-tensor norms",
        )

    def run(self, ctx, defence, targets, models, null, tick):
        fn = self._fn()
        rows, recon, seconds = [], [], 0.0
        for target in targets:
            t0 = time.perf_counter()
            preds = fn(models[target.server_round - 1], target.grads, ctx.tokenizer, len(target.references))
            seconds += time.perf_counter() - t0
            rows.append(text_scores(preds, target.references, ctx.tokenizer, ctx.alignment))
            if target is targets[0]:
                recon = reconstruction_rows(ctx, defence.name, self.name, target.references, preds)
            tick(COST["text"])
        scores = _mean(rows)
        record = AttackRecord(
            ctx.kind,
            defence.name,
            self.name,
            "rouge1",
            scores["rouge1"],
            null.score,
            len(rows),
            round(seconds, 2),
            rouge1=scores["rouge1"],
            rouge2=scores["rouge2"],
            rougeL=scores["rougeL"],
            token_recall=scores["token_recall"],
            exact_rate=scores["exact_rate"],
            null_token_recall=null.token_recall,
        )
        return record, recon


class _Fingerprint(AuditAttack):
    metric = "accuracy"

    def applies(self, kind, defence):
        return defence.aegis is not None

    def null(self, ctx, first):
        return NullBaseline(ctx.kind, self.name, round(1 / ctx.config.candidates, 4), how="1 / N (a random pick)")

    @staticmethod
    def _score(
        ctx: ModelContext,
        defence: DefenceSpec,
        model: nn.Module,
        candidates: list[dict[str, Tensor]],
        observations: list[tuple[list[dict[str, Tensor]], int]],
        tick,
    ) -> tuple[dict[str, float], dict[str, list[float]]]:
        """Every variant's accuracy (mean P(truth first), ties at random) over the trials, scoring each
        candidate once (its prediction is dropped before the next: the likelihood variant keeps the
        candidate's whole signal). A trial holds K independent exports of one batch; their scores add
        (each is a negative log-likelihood), the joint test of an attacker who knows K."""
        from ..attacks.fingerprint import VARIANTS, FingerprintAttack, rank_of_truth, top_share

        if defence.aegis is None:  # applies() keeps the fingerprint rows to AEGIS
            raise ValueError(f"{defence.name}: the fingerprint attacks read an AEGIS flood's public calibration")
        attack = FingerprintAttack(model, defence.aegis)
        obs = [([attack.observe(e) for e in exports], truth) for exports, truth in observations]
        scores = {v: [[0.0] * len(candidates) for _ in obs] for v in VARIANTS}
        for c, batch in enumerate(candidates):
            pred = attack.predict(batch, keep_signal=True)
            for v in VARIANTS:
                for i, (trial, _) in enumerate(obs):
                    scores[v][i][c] = sum(attack.score(o, pred, v) for o in trial)
            del pred
            tick(COST["candidate"])
        accuracy = {v: round(sum(top_share(s, t) for s, (_, t) in zip(scores[v], obs)) / len(obs), 4) for v in VARIANTS}
        ranks = {v: [rank_of_truth(s, t) for s, (_, t) in zip(scores[v], obs)] for v in VARIANTS}
        return accuracy, ranks

    @staticmethod
    def _best(accuracy: dict[str, float], ranks: dict[str, list[float]], n: int) -> tuple[str, float]:
        """The variant the verdict rests on (highest accuracy, then lowest mean rank) and the rank-sum
        p-value of the best variant by p, Bonferroni over the variants."""
        best = max(accuracy, key=lambda v: (accuracy[v], -sum(ranks[v])))
        p = min(1.0, len(ranks) * min(rank_sum_p(r, n) for r in ranks.values()))
        return best, p


class FingerprintPool(_Fingerprint):
    """Which of N candidate batches each captured gradient came from: the round's true batches (every
    client's) and decoy batches of the same size drawn (seeded) from sentences no client trains on."""

    name = "fingerprint_pool"

    def units(self, config, targets):
        return config.candidates * max(1, targets // max(1, config.clients)) * COST["candidate"]

    def run(self, ctx, defence, targets, models, null, tick):
        n = ctx.config.candidates
        record_scores: dict[str, list[float]] = {}
        ranks: dict[str, list[float]] = {}
        seconds, trials = 0.0, 0
        for r in sorted({t.server_round for t in targets}):
            round_targets = [t for t in targets if t.server_round == r]
            truths = [t.examples for t in round_targets]
            size = len(truths[0])
            rng = random.Random(ctx.config.seed * 1000 + r)
            pool = list(ctx.decoys)
            rng.shuffle(pool)
            decoys = [pool[i * size : (i + 1) * size] for i in range(max(0, n - len(truths)))]
            decoys = [d for d in decoys if len(d) == size]
            candidates = [t.batch for t in round_targets] + [ctx.build(d) for d in decoys]
            t0 = time.perf_counter()
            accuracy, rk = self._score(
                ctx, defence, models[r - 1], candidates, [([t.grads], i) for i, t in enumerate(round_targets)], tick
            )
            seconds += time.perf_counter() - t0
            for v, a in accuracy.items():
                record_scores.setdefault(v, []).append(a * len(round_targets))
                ranks.setdefault(v, []).extend(rk[v])
            trials += len(round_targets)
            n = len(candidates)
        variants = {v: round(sum(s) / trials, 4) for v, s in record_scores.items()}
        best, p = self._best(variants, ranks, n)
        note = (
            f"best variant {best}; truth's mean rank {sum(ranks[best]) / len(ranks[best]):.1f} of {n}; "
            f"batches of {len(targets[0].examples)}"
        )
        return AttackRecord(
            ctx.kind,
            defence.name,
            self.name,
            "accuracy",
            variants[best],
            null.score,
            trials,
            round(seconds, 2),
            candidates=n,
            variants=variants,
            note=note,
            ranks=ranks[best],
            p_value=round(p, 6),
        ), []


class FingerprintSecret(_Fingerprint):
    """Secret completion: the client trains on "my pin is V" (B = 1) through the defence; the server scores
    the N same-format values. ``secret_trials`` trials, seeded truths.

    Each trial exports the secret K times, K = the configuration's exposure budget (the number of
    exports of one example its strength is promised for: ``AegisConfig.exposures``), and the server
    scores every candidate against all K exports jointly (the sum of the per-export scores: stronger
    than attacking their mean, ``aegis.attacks.repeated``, whose noise level no longer matches a single
    export's prediction). One more export of the same secret is then tried: the record says whether
    the shield refused it."""

    name = "fingerprint_secret"

    @staticmethod
    def exposures(defence: DefenceSpec) -> int:
        return int(getattr(defence.aegis, "exposures", 1) or 1)

    def units(self, config, targets):
        return config.secret_trials * COST["trial"] + config.candidates * COST["candidate"]

    def run(self, ctx, defence, targets, models, null, tick):
        cfg = ctx.config
        rng = random.Random(cfg.seed)
        values = [f"{v:04d}" for v in rng.sample(range(10000), cfg.candidates)]
        label = next(iter(sorted(ctx.label_ids)), None)
        secret = [Example(SECRET_TEMPLATE.format(v), label) for v in values]
        candidates = [ctx.build([e]) for e in secret]
        truths = rng.sample(range(cfg.candidates), cfg.secret_trials)
        k = self.exposures(defence)
        client = server_copy(ctx.model)  # the client's copy of the round-1 model, protected in place
        shield = Aegis(defence.aegis).attach(client)
        t0 = time.perf_counter()
        observations, refused = [], 0
        for truth in truths:
            exports = [{n: v.detach().clone() for n, v in shield.step(candidates[truth])[1].items()} for _ in range(k)]
            observations.append((exports, truth))
            try:
                shield.step(candidates[truth])  # export K + 1 of the same example
            except RuntimeError as err:
                if "exposure budget" not in str(err):
                    raise
                refused += 1
            tick(COST["trial"])
        shield.detach()
        accuracy, ranks = self._score(ctx, defence, models[0], candidates, observations, tick)
        seconds = time.perf_counter() - t0
        best, p = self._best(accuracy, ranks, cfg.candidates)
        after = (
            f"export {k + 1} refused"
            if refused == len(truths)
            else f"export {k + 1} accepted in {len(truths) - refused} of {len(truths)} trials"
        )
        note = (
            f"K = {k} exports per trial (the exposure budget), scored jointly; {after}; best variant {best}; "
            f"truth's mean rank {sum(ranks[best]) / len(ranks[best]):.1f} of {cfg.candidates}"
        )
        return AttackRecord(
            ctx.kind,
            defence.name,
            self.name,
            "accuracy",
            accuracy[best],
            null.score,
            len(truths),
            round(seconds, 2),
            candidates=cfg.candidates,
            variants=accuracy,
            note=note,
            exposures=k,
            refused_after=k if refused == len(truths) else None,
            ranks=ranks[best],
            p_value=round(p, 6),
        ), []


def make(name: str) -> AuditAttack:
    """The audit's attack of a registry name (:mod:`aegis.attacks.registry`)."""
    family = attack(name, "--attacks").family
    if family is Family.TEXT:
        return TextAttack(name)
    if family is Family.LOSS:
        return LossOracle()
    if family is Family.LABELS:
        return LabelAttack()
    return {"fingerprint_pool": FingerprintPool, "fingerprint_secret": FingerprintSecret}[name]()
