"""The audit's ``loss_oracle`` row: which of N candidate batches each reply came from, read from the loss
value the reply reported (``aegis.attacks.loss_oracle``).

The candidates are those of ``fingerprint_pool`` (the round's true batches of every client, then decoy
batches of the same size from sentences no client trains on); each is scored by its loss under the server's
global model of that round, and the candidate closest to the reported loss is the guess. A reply that
carries no loss (AEGIS replies never do; the audit's clients send only ``num-examples``) gives the oracle
nothing to read: the row says so (``applicable=False``) instead of scoring it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

from torch import Tensor

from ..attacks.loss_oracle import batch_losses, rank_by_loss, reported_loss
from .attack_base import COST, AuditAttack, ModelContext, Target
from .records import AttackRecord, NullBaseline, rank_sum_p


def round_candidates(ctx: ModelContext, round_targets: list[Target], server_round: int) -> list[Mapping[str, Tensor]]:
    """The round's true batches (in target order), then seeded decoy batches of the same size: N in all."""
    n = ctx.config.candidates
    size = len(round_targets[0].examples)
    rng = random.Random(ctx.config.seed * 1000 + server_round)
    pool = list(ctx.decoys)
    rng.shuffle(pool)
    decoys = [pool[i * size : (i + 1) * size] for i in range(max(0, n - len(round_targets)))]
    return [t.batch for t in round_targets] + [ctx.build(d) for d in decoys if len(d) == size]


class LossOracle(AuditAttack):
    name, metric, unit = "loss_oracle", "accuracy", "oracle"

    def null(self, ctx, first):
        return NullBaseline(ctx.kind, self.name, round(1 / ctx.config.candidates, 4), how="1 / N (a random pick)")

    def units(self, config, targets):
        return targets * COST[self.unit]

    def run(self, ctx, defence, targets, models, null, tick):
        readable = [(t, reported_loss(t.metrics)) for t in targets]
        if not any(loss for _, loss in readable):
            carried = sorted({k for t in targets for k in t.metrics})
            tick(COST[self.unit] * len(targets))
            note = (
                f"nothing to read: none of the {len(targets)} replies carried a loss (their metrics: "
                f"{', '.join(carried) or 'none'}); the score is the null by construction, not a measurement"
            )
            return AttackRecord(
                ctx.kind,
                defence.name,
                self.name,
                "accuracy",
                null.score,
                null.score,
                0,
                0.0,
                candidates=ctx.config.candidates,
                note=note,
                applicable=False,
            ), []
        t0 = time.perf_counter()
        shares: list[float] = []
        ranks: list[float] = []
        keys: set[str] = set()
        n = ctx.config.candidates
        for r in sorted({t.server_round for t in targets}):
            round_targets = [t for t in targets if t.server_round == r]
            candidates = round_candidates(ctx, round_targets, r)
            n = len(candidates)
            losses = batch_losses(models[r - 1], candidates)
            for i, target in enumerate(round_targets):
                found = reported_loss(target.metrics)
                if found is None:
                    continue
                keys.add(found[0])
                ranking = rank_by_loss(found[1], losses)
                shares.append(ranking.top_share(i))
                ranks.append(ranking.rank(i))
            tick(COST[self.unit] * len(round_targets))
        score = round(sum(shares) / len(shares), 4)
        note = (
            f"read {', '.join(sorted(keys))} of {len(shares)} of {len(targets)} replies; truth's mean rank "
            f"{sum(ranks) / len(ranks):.1f} of {n}"
        )
        return AttackRecord(
            ctx.kind,
            defence.name,
            self.name,
            "accuracy",
            score,
            null.score,
            len(shares),
            round(time.perf_counter() - t0, 2),
            candidates=n,
            note=note,
            ranks=ranks,
            p_value=round(rank_sum_p(ranks, n), 6),
        ), []
