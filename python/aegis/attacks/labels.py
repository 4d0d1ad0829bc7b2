"""The label channel: which classes (and how many of each) a classifier's batch held, from its head gradient.

For a linear classification head ``z = W h + b`` trained with mean cross-entropy over a batch of ``B``,

    ∂L/∂b = g     = (1/B) Σ_b (p_b − y_b)              (C entries, one per class)
    ∂L/∂W = G_W   = (1/B) Σ_b (p_b − y_b) h_bᵀ         (C × d)

with ``p_b`` the softmax and ``y_b`` the one-hot label of sample ``b``, and ``h_b`` the head's input (BERT's pooled
output, RoBERTa's ``classifier.dense`` output, a decoder's last hidden state …). Writing ``p̄`` for the batch-mean
prediction and ``n_c`` for the number of samples of class ``c``: ``g_c = p̄_c − n_c / B``, hence

    n_c = B (p̄_c − g_c).

This is iDLG's observation (Zhao et al. 2020: with B = 1 the label is the only negative entry) extended to
counts, as in LLG (Wainakh et al. 2022) and iLRG (Ma et al. 2023): the standard first step of inversion attacks.

Channels, in the order :func:`label_leak` reads them:

* ``"bias"`` — the head bias gradient when it is *clean*: every row of ``P − Y`` sums to zero, so a real bias
  gradient sums to zero across classes to rounding (|Σ_c g_c| ≤ 1e-4 Σ_c |g_c|), while any additive noise breaks
  this with probability ≈ 1 (a Gaussian flood passes the test with probability ~1e-4). This is how a flooded bias
  is recognised and set aside.
* ``"weight"`` — the head weight gradient (the bias is absent, e.g. GPT-2/LLaMA ``score``, or flooded). Of the
  two options in the literature — per-row norms / row sums (LLG: with non-negative ReLU features the row sum of
  ``G_W`` has the sign of ``g_c``), or the inner product with an estimate of the feature — we take the second,
  because the heads' inputs here are tanh / LayerNorm outputs of either sign, which breaks LLG's row-sum sign
  argument, while transformer features are strongly anisotropic (MiniLM pooled outputs: cosine 0.6–0.8 with
  the mean feature): with ``r`` the mean feature, ``G_W r / ‖r‖² = (1/B) Σ_b (p_b − y_b) ⟨h_b, r⟩/‖r‖² ≈ g``.
  ``r`` is estimated data-free, as LLG estimates its "impact" from dummy inputs: the server runs its own copy of
  the model on random token sequences (or on ``probe_inputs`` it supplies, e.g. public text) and averages the
  head's inputs. Before projecting, the class mean of ``G_W`` is subtracted: the true rows sum to zero, so that
  direction holds only noise. Norms alone would not do: they lose the sign that tells a present class from an
  absent one, and a flood of the weight gradient keeps the projection (averaged over ``d`` entries) readable
  long after it has buried the per-entry signs.
* ``"noisy bias"`` — a bias gradient that failed the test, used (class mean removed) only when the weight
  gradient is absent: a flood with ``rho > 0`` still leaves ``rho · g`` in it.
* ``"none"`` — no head gradient (missing, all zero, non-finite): the attack guesses ``B`` labels uniformly at
  random from a fixed ``seed``, whose expected accuracy is :func:`label_null`; it never raises.

From the estimate ``ĝ``: with B = 1 the label is ``argmin ĝ`` (the only negative entry of a clean gradient); a
clean weight gradient needs no reference feature at B = 1 (C ≥ 3): it is the rank-one ``(p − y) hᵀ``, and along its
top singular vector the label's coefficient is the largest in magnitude. The projection on ``r`` assumes the
anisotropy above: a randomly initialised decoder, whose last hidden states point anywhere, defeats it at B > 1. With
B > 1 the real counts ``B (p̄ − ĝ)`` are rounded to non-negative integers summing to ``B`` (largest remainder);
``p̄`` is the mean softmax of the same probe run (the softmax-mass correction). For a fresh head, whose predictions
are near uniform, this is accurate to ~B·0.003 counts on MiniLM; for a trained head the probe's ``p̄`` is only an
estimate, which is the known weak point of count estimation (LLG's offset has the same limitation).

Scale: a defence that multiplies the gradient by ``rho`` (AEGIS's floods export ``rho · clip(G) + σ Z``) shrinks
``ĝ`` by that factor (and by the clip factor when clipping bites), and the shrink cannot be told from the
gradient alone (counts ``n`` and ``2 n − B p̄`` fit a gradient equally well when ``p̄`` is uniform). B = 1 does
not care (argmin); for counts, an adaptive attacker who knows the defence's public parameters (Kerckhoffs: not
its secret seed) passes ``gain=rho``.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "HEAD_NAMES",
    "LabelLeak",
    "LabelTest",
    "find_head",
    "infer_labels",
    "infer_many",
    "label_accuracy",
    "label_leak",
    "label_null",
    "label_test",
]

# Module names (or name suffixes) of the final linear layer of a classification head, most specific first.
HEAD_NAMES = (
    "classifier.out_proj",  # RoBERTa, XLM-R, ELECTRA-style heads: dense -> tanh -> out_proj
    "classification_head.out_proj",  # BART / T5 sequence classification
    "classifier",  # BERT, DistilBERT, DeBERTa, ALBERT
    "score",  # GPT-2 / LLaMA / Mistral ForSequenceClassification (no bias)
    "classification_head",
    "cls",
    "head",
)

_ZERO_SUM = 1e-4  # |Σ_c g_c| / Σ_c |g_c| below which a gradient counts as clean (fp32 rounding is ~1e-7)
_PROBES, _PROBE_LEN, _PROBE_SEED = 8, 16, 0


@dataclass
class Head:
    """The final linear layer of a classification head and the names its parameters have in a gradient dict."""

    path: str
    module: nn.Linear
    weight: list[str]
    bias: list[str] = field(default_factory=list)

    @property
    def num_labels(self) -> int:
        return self.module.out_features


@dataclass
class LabelLeak:
    """What the head gradient gave away: the label multiset and how it was read."""

    labels: list[int]  # sorted, with multiplicity, length batch_size
    channel: str  # "bias", "weight", "noisy bias" or "none"
    estimate: list[float] | None = None  # ĝ: the estimated bias gradient (None for "none")
    counts: list[float] | None = None  # the real counts B (p̄ − ĝ) before rounding (None when B = 1 or "none")


# -- locating the head ---------------------------------------------------------------------------------------------


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _last_linear(module: nn.Module) -> nn.Linear | None:
    if isinstance(module, nn.Linear):
        return module
    last = None
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            last = sub
    return last


# model -> {head argument: (the Head, its weight, its bias)}
_HEAD_CACHE: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def find_head(model: nn.Module, head: str | None = None) -> Head:
    """The classification head's final ``nn.Linear``: the module ``head`` when given, else the first module whose
    name is, or ends in, one of :data:`HEAD_NAMES` (a container counts through its last ``nn.Linear``).

    Raises ``ValueError`` naming what it looked for when nothing matches. Cached per model (a search walks every
    module, and an attack reads thousands of exports of one model) while the head's module and tensors stay."""
    cached = _HEAD_CACHE.get(model, {}).get(head)
    if cached is not None:
        found, weight, bias = cached
        try:
            current = model.get_submodule(found.path)
        except AttributeError:
            current = None
        if current is found.module and current.weight is weight and current.bias is bias:
            return found
    found = _find_head(model, head)
    _HEAD_CACHE.setdefault(model, {})[head] = (found, found.module.weight, found.module.bias)
    return found


def _find_head(model: nn.Module, head: str | None) -> Head:
    modules = dict(model.named_modules())
    wanted = (head,) if head is not None else HEAD_NAMES
    for cand in wanted:
        matches = [n for n in modules if n == cand or n.endswith("." + cand)]
        for name in sorted(matches, key=len):
            linear = _last_linear(modules[name])
            if linear is None:
                continue
            path = next(n for n, m in modules.items() if m is linear)
            aliases = _aliases(model)
            bias = aliases.get(id(linear.bias), []) if linear.bias is not None else []
            return Head(path, linear, aliases.get(id(linear.weight), []), bias)
    looked = f"module {head!r}" if head is not None else "a module named " + ", ".join(repr(n) for n in HEAD_NAMES)
    raise ValueError(
        f"no classification head found in {type(model).__name__}: looked for {looked} (or a name ending in it) "
        "containing an nn.Linear; pass head='path.to.module' to name it"
    )


# -- reading the channels ------------------------------------------------------------------------------------------


def _read(grads: Mapping[str, Tensor], names: list[str]) -> Tensor | None:
    """The gradient under any alias as float64 on CPU; None when missing, empty, all-zero or non-finite."""
    for name in names:
        g = grads.get(name)
        if g is None:
            continue
        g = torch.as_tensor(g).detach()
        if g.is_sparse:
            g = g.to_dense()
        if g.numel() == 0 or not bool(torch.isfinite(g).all()) or not bool(g.any()):
            return None
        return g.double().cpu()
    return None


def _clean(g: Tensor) -> bool:
    """True when the class-sum of ``g`` vanishes (per column for the weight): an unperturbed gradient."""
    return float(g.sum(0).abs().sum()) <= _ZERO_SUM * float(g.abs().sum())


def _random_probe(model: nn.Module, device: torch.device) -> dict[str, Tensor]:
    """Random token sequences (fixed seed), ids from the upper part of the vocabulary, away from specials."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab <= 0:
        getter = getattr(model, "get_input_embeddings", None)
        emb = getter() if callable(getter) else None
        vocab = int(emb.weight.shape[0]) if emb is not None else 0
    if vocab <= 0:
        raise ValueError("cannot draw probe tokens: the model has no vocab_size; pass probe_inputs=")
    low = min(1000, vocab // 2)
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    ids = torch.randint(low, vocab, (_PROBES, _PROBE_LEN), generator=gen)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


_PROBE_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, tuple[Tensor, Tensor]]] = weakref.WeakKeyDictionary()


def _probe(model: nn.Module, head: Head, probe_inputs: Mapping[str, Tensor] | None) -> tuple[Tensor, Tensor]:
    """(mean head input r, mean prediction p̄) of the model on probe inputs, float64 on CPU.

    The default random probe is cached per model until any parameter changes (tensor identity and version
    counter: an optimizer step or a load_state_dict bumps it), so attacking many batches costs one probe."""
    if probe_inputs is not None:
        return _run_probe(model, head, probe_inputs)
    stamp = (head.path, model.training, *((id(p), p._version) for p in model.parameters()))
    cached = _PROBE_CACHE.get(model)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    result = _run_probe(model, head, None)
    _PROBE_CACHE[model] = (stamp, result)
    return result


def _run_probe(model: nn.Module, head: Head, probe_inputs: Mapping[str, Tensor] | None) -> tuple[Tensor, Tensor]:
    """A decoder's head sees every position: the last one (the one sequence classification reads) is used.
    Sequences are run one at a time if the batch is refused (e.g. decoders without a pad token)."""
    device = next(model.parameters()).device
    inputs = dict(probe_inputs) if probe_inputs is not None else _random_probe(model, device)
    inputs = {k: torch.as_tensor(v).to(device) for k, v in inputs.items()}
    seen: dict[str, list[Tensor]] = {"x": [], "z": []}

    def hook(_module, args, out):
        x, z = args[0].detach(), out.detach()
        if x.dim() == 3:  # (batch, positions, d): the last position
            x, z = x[:, -1], z[:, -1]
        seen["x"].append(x.reshape(-1, x.shape[-1]).double().cpu())
        seen["z"].append(z.reshape(-1, z.shape[-1]).double().cpu())

    was_training = model.training
    handle = head.module.register_forward_hook(hook)
    model.eval()
    try:
        with torch.no_grad():
            try:
                model(**inputs)
            except Exception:
                seen["x"].clear()
                seen["z"].clear()
                for i in range(inputs["input_ids"].shape[0]):
                    model(**{k: v[i : i + 1] for k, v in inputs.items()})
    finally:
        handle.remove()
        model.train(was_training)
    if not seen["x"]:
        raise RuntimeError(f"the probe forward never reached the head {head.path!r}; pass probe_inputs=")
    x, z = torch.cat(seen["x"]), torch.cat(seen["z"])
    return x.mean(0), z.softmax(-1).mean(0)


# -- counting ------------------------------------------------------------------------------------------------------


def _round_counts(real: Tensor, total: int) -> list[int]:
    """Non-negative integers summing to ``total``, closest to ``real`` (largest remainder)."""
    real = real.clamp_min(0.0)
    counts = real.floor().long()
    excess = int(counts.sum()) - total
    if excess > 0:
        # The loop below removes units in decreasing order of (count - estimate). Its first sum_c min(f_c, m)
        # steps take exactly the units above -m, i.e. max(f_c - m, 0) remain: take the largest such m at once
        # (a flooded head read at a tiny gain gives estimates of 10^6 and more).
        lo, hi = 0, int(counts.max())
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if int(counts.clamp(max=mid).sum()) <= excess else (lo, mid - 1)
        counts = (counts - lo).clamp_min(0)
    while int(counts.sum()) > total:  # remove from the class that exceeds its estimate the most
        over = torch.where(counts > 0, counts - real, torch.full_like(real, -math.inf))
        counts[int(over.argmax())] -= 1
    while int(counts.sum()) < total:  # add to the class furthest below its estimate
        counts[int((real - counts).argmax())] += 1
    return counts.tolist()


def label_leak(
    model: nn.Module,
    grads: Mapping[str, Tensor],
    batch_size: int,
    *,
    head: str | None = None,
    gain: float = 1.0,
    probe_inputs: Mapping[str, Tensor] | None = None,
    seed: int = 0,
) -> LabelLeak:
    """The label multiset of the batch behind ``grads`` and the channel it was read from (see the module doc).

    ``head``: module path of the classification head (default: found by name, :func:`find_head`).
    ``gain``: the factor a defence is known to multiply the head gradient by (a flood's ``rho``); 1 = none.
    ``probe_inputs``: model inputs (``input_ids`` …) the server uses to estimate the mean feature and prediction;
    default: random token sequences. ``seed``: the guess when no channel is open."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if not gain > 0:
        raise ValueError(f"gain={gain}: must be > 0")
    h = find_head(model, head)
    return _leak(h, lambda: _probe(model, h, probe_inputs), grads, batch_size, gain, seed)


def _leak(h: Head, probe_of, grads: Mapping[str, Tensor], batch_size: int, gain: float, seed: int) -> LabelLeak:
    """:func:`label_leak` once the head is found; ``probe_of()`` gives (r, p̄), called only when needed."""
    bias, weight = _read(grads, h.bias), _read(grads, h.weight)
    probe: tuple[Tensor, Tensor] | None = None

    if bias is not None and _clean(bias):
        channel, g = "bias", bias
    elif weight is not None:
        probe = probe_of()
        r = probe[0]
        centred = weight - weight.mean(0, keepdim=True)
        channel, g = "weight", centred @ r / (r @ r)
    elif bias is not None:
        channel, g = "noisy bias", bias - bias.mean()
    else:
        gen = torch.Generator().manual_seed(seed)
        guess = torch.randint(0, h.num_labels, (batch_size,), generator=gen)
        return LabelLeak(sorted(guess.tolist()), "none")
    g = g / gain

    if batch_size == 1:
        if channel == "weight" and weight is not None and h.num_labels >= 3 and _clean(weight):
            # G_W = (p − y) hᵀ exactly: along its top right singular vector the label's coefficient p_y − 1 is
            # the largest in magnitude (|p_y − 1| = Σ_{c≠y} p_c), whatever the sign of ⟨h, r⟩.
            top = torch.linalg.svd(weight, full_matrices=False).Vh[0]
            return LabelLeak([int((weight @ top).abs().argmax())], channel, g.tolist())
        return LabelLeak([int(g.argmin())], channel, g.tolist())
    if probe is None:
        probe = probe_of()
    real = batch_size * (probe[1] - g)
    counts = _round_counts(real, batch_size)
    labels = [c for c, n in enumerate(counts) for _ in range(n)]
    return LabelLeak(labels, channel, g.tolist(), real.tolist())


def infer_many(
    model: nn.Module, exports: Sequence[Mapping[str, Tensor]], batch_size: int, *, gain: float = 1.0, seed: int = 0
) -> list[list[int]]:
    """:func:`infer_labels` (default head and random probe) of many exports of one model, which does not change
    meanwhile: the head and the probe are looked up once, not once per export."""
    if batch_size < 1 or not gain > 0:
        raise ValueError(f"batch_size={batch_size}, gain={gain}: batch_size must be >= 1 and gain > 0")
    h = find_head(model)
    probe: list[tuple[Tensor, Tensor]] = []

    def probe_of() -> tuple[Tensor, Tensor]:
        if not probe:
            probe.append(_probe(model, h, None))
        return probe[0]

    return [_leak(h, probe_of, grads, batch_size, gain, seed).labels for grads in exports]


def infer_labels(model: nn.Module, grads: Mapping[str, Tensor], batch_size: int, **options) -> list[int]:
    """The multiset of labels (sorted, length ``batch_size``) of the batch behind ``grads``.

    Reads the head bias gradient when it is clean, else the head weight gradient projected on the mean feature,
    else a flooded bias; guesses uniformly when no head gradient is open. Options: see :func:`label_leak`."""
    return label_leak(model, grads, batch_size, **options).labels


# -- scoring -------------------------------------------------------------------------------------------------------


def label_accuracy(pred: list[int], true: list[int]) -> float:
    """Multiset accuracy: Σ_c min(#pred of c, #true of c) / len(true). Order does not matter."""
    if not true:
        raise ValueError("label_accuracy needs at least one true label")
    from collections import Counter

    p, t = Counter(int(x) for x in pred), Counter(int(x) for x in true)
    return sum(min(n, p[c]) for c, n in t.items()) / len(true)


def label_null(num_labels: int, batch_size: int) -> float:
    """Expected :func:`label_accuracy` of ``batch_size`` uniform guesses against ``batch_size`` uniform labels.

    Per class the two counts are independent Binomial(B, 1/C), so the expectation is (C / B) E[min(X, Y)]
    (exact, by linearity over classes); 1/C for B = 1. This is the chance level of *uniform* guessing only:
    the attack's own guesses on a gradient that carries nothing have structure (largest-remainder counts
    around ``B p̄`` rarely repeat a class), so their chance level is higher at B > 1; :func:`label_test`
    measures it."""
    if num_labels < 1 or batch_size < 1:
        raise ValueError(f"num_labels={num_labels}, batch_size={batch_size}: both must be >= 1")
    q = 1.0 / num_labels
    pmf = [math.comb(batch_size, k) * q**k * (1 - q) ** (batch_size - k) for k in range(batch_size + 1)]
    e_min = sum(pmf[x] * pmf[y] * min(x, y) for x in range(batch_size + 1) for y in range(batch_size + 1))
    return num_labels * e_min / batch_size


@dataclass(frozen=True)
class LabelTest:
    """The label attack over ``n`` batches against its own chance level (see :func:`label_test`)."""

    accuracy: float  # mean label_accuracy of each guess against its own batch
    null: float  # mean accuracy of the guesses against the other batches: the chance level of these guesses
    p_value: float  # permutation p-value: P(accuracy this high | the guesses are independent of the batches)
    n: int


def _counts(multisets: list[list[int]], num_labels: int) -> np.ndarray:
    out = np.zeros((len(multisets), num_labels))
    for i, labels in enumerate(multisets):
        np.add.at(out[i], np.asarray(labels, dtype=int), 1.0)
    return out


def label_test(
    preds: list[list[int]], truths: list[list[int]], num_labels: int, *, permutations: int = 9999, seed: int = 0
) -> LabelTest:
    """Is the attack's accuracy over these batches above what its guesses reach by chance?

    H0: the shared gradients carry nothing of the labels, so each guess is independent of its batch. Under
    H0 the pairing of guesses with batches is exchangeable, so the accuracy is one draw of the mean accuracy
    under a random pairing: ``null`` is that distribution's expectation estimated on the pairs that are
    certainly independent (each guess against every other batch), and ``p_value`` = (1 + #{pairings scoring
    at least the observed accuracy}) / (1 + ``permutations``) over seeded random pairings, an exact
    (conservative) p-value. It holds whatever structure the guesses have and whatever the label
    distribution, where :func:`label_null` assumes uniform guesses of uniform labels."""
    n = len(preds)
    if n < 2 or len(truths) != n:
        raise ValueError(f"{n} guesses and {len(truths)} batches: label_test needs the same number, at least 2")
    if permutations < 1:
        raise ValueError(f"permutations={permutations}: use at least 1 (9999 resolves p down to 1e-4)")
    sizes = np.array([len(t) for t in truths], dtype=float)
    if (sizes == 0).any():
        raise ValueError("every batch needs at least one true label")
    p, t = _counts(preds, num_labels), _counts(truths, num_labels)
    scores = np.minimum(p[:, None, :], t[None, :, :]).sum(-1) / sizes[None, :]  # scores[i, j]: guess i, batch j
    accuracy = float(np.trace(scores) / n)
    null = float((scores.sum() - np.trace(scores)) / (n * (n - 1)))
    rng = np.random.default_rng(seed)
    rows, hits, done = np.arange(n), 0, 0
    while done < permutations:
        chunk = min(2000, permutations - done)
        pairing = rng.permuted(np.tile(rows, (chunk, 1)), axis=1)
        hits += int((scores[rows, pairing].mean(1) >= accuracy - 1e-12).sum())
        done += chunk
    return LabelTest(accuracy, null, (1 + hits) / (1 + permutations), n)
