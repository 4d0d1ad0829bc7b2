"""1-of-N candidate verification at any N, from one export or the mean of K.

The server holds the model and the public defence configuration (never the noise key) and has N
candidate batches ("my pin is 0000" ... "my pin is 9999", or N batches of sentences); it predicts what
the defence does to each candidate's gradient and scores every candidate against the exported tensors
with the three ``aegis.attacks.fingerprint`` statistics (``level``, ``energy`` and the Neyman-Pearson
``likelihood``). Unlike ``fingerprint_accuracies`` it never stores a candidate's prediction: candidates
are streamed in chunks whose gradients come from one batched forward/backward
(:mod:`aegis.attacks.per_example`), scored against every observation at once and dropped, so N = 1000
(or 10^5) costs time, not memory.

K exports of one batch under fresh keys average to ``rho clip(G) + (sigma / sqrt K) Z``; the mean is a
sufficient statistic of the K exports for every candidate's Gaussian likelihood, so a :class:`Verifier`
built with ``exposures=K`` scores that mean (``attacks.repeated.averaged_export``) with sigma / sqrt(K).

Scores are "lower = more likely", each up to a constant shared by all candidates (tensors whose
prediction does not depend on the candidate are left out: under the public calibration, every tensor
with rho = 0).

    verifier = Verifier(model, tokenizer, config, exposures=4)
    obs = [verifier.observe(averaged_export(lambda: shared_gradient(...), 4)) for _ in range(trials)]
    scores = verifier.scores(obs, secret_candidates("my pin is {}", pins))   # {variant: (trials, N)}
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import aegis_kernels.reference as ref

from ..calibration import PublicLoss
from ..config import AegisConfig, Calibration
from ..models import is_decoder
from .fingerprint import (
    VARIANTS,
    FingerprintAttack,
    FingerprintResult,
    _eval,
    _level,
    lm_batch,
    rank_of_truth,
    top_share,
)
from .per_example import per_example_gradients, supported

__all__ = ["Candidate", "Observation", "Verifier", "secret_candidates", "verification_accuracy"]

_CHUNK_BYTES = 1 << 30  # per-example gradients held at once (a chunk of candidates)


@dataclass(frozen=True)
class Candidate:
    """One candidate batch: its texts and, for a classifier, one label per text."""

    texts: tuple[str, ...]
    labels: tuple[int, ...] | None = None

    def __post_init__(self):
        if not self.texts:
            raise ValueError("Candidate(texts=()): a candidate batch needs at least one text")
        if self.labels is not None and len(self.labels) != len(self.texts):
            raise ValueError(f"Candidate: {len(self.labels)} labels for {len(self.texts)} texts: give one per text")


def secret_candidates(template: str, values: Sequence[str], known: Sequence[str] = (), *,
                      label: int | None = None, known_labels: Sequence[int] | None = None) -> list[Candidate]:
    """``template.format(v)`` for every value, each batched with the ``known`` texts (B = 1 + len(known));
    ``label`` / ``known_labels`` for a classifier."""
    if "{}" not in template:
        raise ValueError(f"template={template!r}: mark the secret's place with {{}}, e.g. 'my pin is {{}}'")
    if label is None and known_labels is not None:
        raise ValueError("known_labels without label: give the secret's label too (label=...)")
    if label is not None and len(known_labels or ()) != len(known):
        raise ValueError(f"known_labels: {len(known_labels or ())} labels for {len(known)} known texts")
    labels = None if label is None else (label, *(known_labels or ()))
    return [Candidate((template.format(v), *known), labels) for v in values]


@dataclass
class Observation:
    """What the scores read from one (possibly averaged) export, per tensor the attack models:
    robust noise level, elements it rests on, element count, sum of squares, and the tensor itself
    (rows view) where the defence lets signal through (rho > 0)."""

    level: list[float | None]
    kept: list[int]
    n: list[int]
    sq: list[float]
    x: list[Tensor | None]

    def closed(self) -> None:
        """Record a tensor that is absent, all zero or non-finite: nothing to read."""
        self.level.append(None)
        self.kept.append(0)
        self.n.append(0)
        self.sq.append(0.0)
        self.x.append(None)


class Verifier:
    """Scores N candidate batches against exported gradients, chunk by chunk.

    ``exposures``: the number of exports averaged into each observation (K); ``chunk``: candidates per
    batched forward (default: as many as fit ~1 GiB of per-example gradients);
    ``calibration_loss``: the client's public calibration loss (None: the shield's default)."""

    def __init__(self, model: nn.Module, tokenizer, config: AegisConfig, *, exposures: int = 1,
                 chunk: int | None = None, calibration_loss: PublicLoss | None = None):
        if exposures < 1:
            raise ValueError(f"exposures={exposures}: the number of averaged exports is at least 1")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk={chunk}: candidates per batched pass must be at least 1 (or None: automatic)")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.exposures = exposures
        self.decoder = is_decoder(model)
        attack = FingerprintAttack(model, config, calibration_loss)
        self.attack = attack
        if config.calibration is Calibration.BATCH:  # every sigma reads the candidate's gradient
            self.public = None
            self.tensors = list(range(len(attack.tensors)))
            self.signal = {k for k, t in enumerate(attack.tensors) if t.rho > 0}
        else:  # public sigma: only the tensors that let signal through (public rho > 0) tell candidates apart
            self.public = attack.params([])
            self.tensors = [k for k in range(len(attack.tensors)) if float(self.public[k, 0]) > 0]
            self.signal = set(self.tensors)
        params = [attack.tensors[k].param for k in self.tensors]
        self.batched = bool(params) and supported(model, params)
        size = sum(p.numel() for p in params) * 4
        self.chunk = chunk or max(1, _CHUNK_BYTES // max(size, 1))

    # -- observation ---------------------------------------------------------------------------------
    def observe(self, exported: Mapping[str, Tensor]) -> Observation:
        """The statistics of one export (or of the mean of K: see ``exposures``)."""
        obs = Observation([], [], [], [], [])
        for k in self.tensors:
            t = self.attack.tensors[k]
            x = exported.get(t.name)
            if x is None:
                obs.closed()
                continue
            x = _rows(x.detach().float(), t)
            if not torch.isfinite(x).all() or not x.any():  # closed: nothing to read
                obs.closed()
                continue
            level, kept = _level(x)  # 0.0 where most entries are exact zeros (no noise: lam 0)
            obs.level.append(level)
            obs.kept.append(kept)
            obs.n.append(x.numel())
            obs.sq.append(torch.sum(x * x, dtype=torch.float64).item())
            obs.x.append(x.contiguous() if k in self.signal else None)
        return obs

    # -- candidates ----------------------------------------------------------------------------------
    def _chunks(self, candidates: Sequence[Candidate]) -> Iterator[tuple[int, list[Tensor]]]:
        """(start, per tensor of self.tensors: the chunk's clean gradients, (C, ids, width) rows views)."""
        params = [self.attack.tensors[k].param for k in self.tensors]
        for start in range(0, len(candidates), self.chunk):
            part = candidates[start : start + self.chunk]
            grads = self._batched(part, params) if self.batched else self._one_by_one(part, params)
            yield start, [_rows(g, self.attack.tensors[k], batched=True) for g, k in zip(grads, self.tensors)]

    def _one_by_one(self, part: Sequence[Candidate], params) -> list[Tensor]:
        """One forward/backward per candidate (parameters outside ``per_example.supported`` modules)."""
        per = []
        with _eval(self.model), torch.enable_grad():
            for c in part:
                grads = torch.autograd.grad(self.model(**self._batch(c)).loss, params, allow_unused=True)
                per.append([torch.zeros_like(p) if g is None else g.detach().float() for g, p in zip(grads, params)])
        return [torch.stack(column) for column in zip(*per)]

    def _labels(self, c: Candidate) -> list[int] | None:
        """The candidate's labels for a classifier (required), None for a decoder."""
        if self.decoder:
            return None
        if c.labels is None:
            raise ValueError("an encoder's candidates need labels: Candidate(texts, labels=(...))")
        return list(c.labels)

    def _batch(self, c: Candidate) -> dict[str, Tensor]:
        return lm_batch(self.tokenizer, list(c.texts), self.model, self._labels(c))

    def _batched(self, part: Sequence[Candidate], params) -> list[Tensor]:
        rows = max(len(c.texts) for c in part)
        texts: list[str] = []
        labels: list[int] = []
        real: list[bool] = []
        for c in part:
            own = self._labels(c)
            pad = rows - len(c.texts)
            texts += [*c.texts, *[c.texts[0]] * pad]  # filler rows, masked out of the loss below
            real += [True] * len(c.texts) + [False] * pad
            if own is not None:
                labels += [*own, *[-100] * pad]
        enc = lm_batch(self.tokenizer, texts, self.model, None if self.decoder else labels)
        keep = torch.tensor(real, device=enc["input_ids"].device)
        target = enc["labels"].masked_fill(~keep[:, None], -100) if self.decoder else enc["labels"]
        with _eval(self.model):
            return per_example_gradients(self.model, params, enc["input_ids"], enc["attention_mask"], target,
                                         len(part), decoder=self.decoder)

    # -- scoring -------------------------------------------------------------------------------------
    def scores(self, observations: Sequence[Observation], candidates: Sequence[Candidate],
               variants: Sequence[str] = VARIANTS) -> dict[str, Tensor]:
        """{variant: (len(observations), len(candidates)) float64 scores}, lower = likelier."""
        for v in variants:
            if v not in VARIANTS:
                raise ValueError(f"variant={v!r}: use one of {VARIANTS}")
        if not candidates:
            raise ValueError("candidates=[]: give at least one candidate batch")
        out = {v: torch.zeros(len(observations), len(candidates), dtype=torch.float64) for v in variants}
        if not self.tensors:  # nothing the defence exports depends on the candidate: all tie
            return out
        for start, grads in self._chunks(candidates):
            for j, (k, g) in enumerate(zip(self.tensors, grads)):
                for v, s in self._tensor_scores(j, k, g, observations, variants).items():
                    out[v][:, start : start + g.shape[0]] += s.cpu()
        return out

    def _params(self, k: int, g: Tensor) -> Tensor:
        """(C, 4) (rho, sigma, clip, thr) for each candidate's gradient of tensor k."""
        if self.public is not None:
            return self.public[k].to(torch.float64).expand(g.shape[0], 4)
        t, tau = self.attack.tensors[k], self.config.rel_threshold
        return torch.stack([ref.batch_params(x, t.mode, t.rho, t.lam, tau).cpu() for x in g]).double()

    def _tensor_scores(self, j: int, k: int, g: Tensor, observations: Sequence[Observation],
                       variants: Sequence[str]) -> dict[str, Tensor]:
        t = self.attack.tensors[k]
        rho, sigma, clip, thr = self._params(k, g).to(g.device).unbind(1)
        noisy = sigma > 0
        # lam 0 exports no noise: the likelihood degenerates to least squares (any constant scale ranks alike)
        sigma = torch.where(noisy, sigma / math.sqrt(self.exposures), torch.ones_like(sigma))
        energy, weighted = _signal(g, t.mode, rho, clip, thr)  # ||rho clip(G)||^2 and rho clip(G) (or None)
        xs = [o.x[j] for o in observations]
        cross = torch.zeros(len(observations), g.shape[0], dtype=torch.float64, device=g.device)
        if weighted is not None and any(x is not None for x in xs):
            rows, w = weighted
            for i, x in enumerate(xs):
                if x is not None:
                    part = x if rows is None else x.index_select(0, rows)
                    cross[i] = (w.reshape(w.shape[0], -1) @ part.reshape(-1).to(w.dtype)).double()
        out = {}
        for v in variants:
            s = torch.zeros_like(cross)
            for i, o in enumerate(observations):
                level = o.level[j]
                if level is None:
                    continue
                n = o.n[j]
                if v == "level":
                    if t.mode == "matrix" and t.rho > 0 or level <= 0:
                        continue  # signal spread over the tensor (or no noise): the level is not the noise's
                    s[i] = torch.where(noisy, 2 * o.kept[j] * (math.log(level) - sigma.log()) ** 2, 0.0)
                elif v == "energy":
                    expected = (energy + torch.where(noisy, sigma**2, 0.0) * n) / n
                    s[i] = n / 2 * (math.log(o.sq[j] / n) - expected.clamp_min(1e-300).log()) ** 2
                else:
                    s[i] = n * sigma.log() + (o.sq[j] - 2 * cross[i] + energy) / (2 * sigma**2)
            out[v] = s
        return out


def _rows(x: Tensor, t, *, batched: bool = False) -> Tensor:
    """The flood's view of a tensor (``batched``: of each candidate's): ids along the first axis for a
    rows flood (transposed when the ids index the columns; a vocabulary vector as rows of width 1)."""
    lead = 1 if batched else 0
    if t.mode != "rows":
        return x
    if x.dim() == lead + 1:
        return x.unsqueeze(-1)
    return x.transpose(lead, lead + 1) if t.transposed else x


def _signal(g: Tensor, mode: str, rho: Tensor, clip: Tensor, thr: Tensor) -> tuple[Tensor, tuple | None]:
    """Each candidate's ||rho clip(G)||^2 and the weighted signal rho clip(G) on the rows any candidate
    exports (rows flood: the union of rows above threshold; matrix flood: all of it, rows None)."""
    c = g.shape[0]
    if mode == "rows":
        norms = torch.linalg.vector_norm(g, dim=2)  # (C, V), fp32 as the flood computes them
        active = norms > thr.float()[:, None]
        w = rho.float()[:, None] * ref.clip_scale(norms, clip.float()[:, None]) * active
        energy = ((w.double() * norms.double()) ** 2).sum(1)
        rows = active.any(0).nonzero().flatten()
        if not bool((rho > 0).any()) or rows.numel() == 0:
            return energy, None
        return energy, (rows, w[:, rows, None] * g[:, rows])
    norms = torch.linalg.vector_norm(g.reshape(c, -1), dim=1)
    scale = rho.float() * ref.clip_scale(norms, clip.float())
    energy = (scale.double() * norms.double()) ** 2
    if not bool((scale > 0).any()):
        return energy, None
    return energy, (None, scale.view(c, *[1] * (g.dim() - 1)) * g)


def verification_accuracy(verifier: Verifier, observations: Sequence[Observation], truths: Sequence[int],
                          candidates: Sequence[Candidate],
                          variants: Sequence[str] = VARIANTS) -> dict[str, FingerprintResult]:
    """Per variant: how often ``candidates[truths[j]]`` ranks first for observation j (ties split)."""
    if len(truths) != len(observations):
        raise ValueError(f"{len(truths)} truths for {len(observations)} observations: give one per observation")
    if len(candidates) < 2:
        raise ValueError(f"{len(candidates)} candidate(s): a 1-of-N test needs at least 2")
    return score_accuracy(verifier.scores(observations, candidates, variants), truths)


def score_accuracy(scores: Mapping[str, Tensor], truths: Sequence[int]) -> dict[str, FingerprintResult]:
    """Per variant of (trials, N) scores (lower = likelier): how often trial j ranks ``truths[j]`` first."""
    out = {}
    for v, s in scores.items():
        if s.shape[0] != len(truths):
            raise ValueError(f"{s.shape[0]} scored trials for {len(truths)} truths: give one truth per trial")
        rows = [s[j].tolist() for j in range(len(truths))]
        shares = [top_share(r, t) for r, t in zip(rows, truths)]
        ranks = [rank_of_truth(r, t) for r, t in zip(rows, truths)]
        out[v] = FingerprintResult(sum(shares) / len(shares), 1 / s.shape[1], ranks, s.shape[1], v)
    return out
