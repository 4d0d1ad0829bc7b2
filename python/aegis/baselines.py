"""Defences AEGIS is compared against, behind the :class:`~aegis.defence.Defence` interface it shares.

Every comparator is a :class:`Defence` (:mod:`aegis.defence`: attach, backward, ``defend_``, export), so
``benchmarks/overhead.py`` times each part and the audit captures what a client would share::

    defence = Pruning(0.9).attach(model, optimizer)
    loss = defence.backward(batch, loss_fn)   # forward + backward (DP-SGD: per-sample gradients)
    defence.defend_()                          # rewrite p.grad in place
    shared = defence.export()                  # {name: gradient} of trainable parameters (what leaves)

The interface, :class:`NoDefence`, :class:`Aegis` and :func:`lm_loss` are re-exported from
:mod:`aegis.defence`; the product path (``aegis.fl``, the shield) never imports this module.

The baselines (``make_defence`` builds them from the names :mod:`aegis.registry` parses, e.g.
``"dp-noise-0.01"``, ``"prune-90"``):

* :class:`NoDefence` ("none") — the plain gradient.
* :class:`Aegis` ("aegis", "aegis-sentences") — :func:`aegis.protect`: attention frozen, flood, masked export.
* :class:`GaussianNoise` ("dp-noise-σ") — DAGER's noise defence: ``g + σ·N(0, 1)`` on every gradient
  element, σ ∈ {1e-3, 1e-2, 1e-1} in the comparison (no clipping, so no (ε, δ) guarantee).
* :class:`DPSGD` ("dp-sgd", "dp-sgd-C1-z1") — Opacus DP-SGD: per-sample gradients (Opacus hooks),
  per-sample clipping to C (flat, over all trainable parameters), Gaussian noise of std ``z·C`` on the sum,
  division by the batch size; ε from Opacus's RDP accountant at ``delta``.
* :class:`Pruning` ("prune-90") — zero the smallest-magnitude fraction of every gradient tensor.
* :class:`Soteria` ("soteria-80") — Sun et al. 2021 adapted to transformers, see the class docstring.

Only torch is needed to import this module; Opacus is imported when a DPSGD defence is attached.
"""
from __future__ import annotations

import inspect
import math
import secrets
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .config import AegisConfig
from .defence import Aegis, Batch, Defence, LossFn, NoDefence, core_defence, lm_loss, trainable_gradients
from .registry import DefenceKind, DefenceSpec, parse_defence

__all__ = [
    "DPSGD", "DP_NOISE_SIGMAS", "PRUNING_FRACTIONS", "Aegis", "Batch", "Defence", "GaussianNoise", "LossFn",
    "NoDefence", "Pruning", "Soteria", "add_noise", "add_noise_", "default_baselines", "lm_loss", "make_defence",
    "prune", "prune_", "trainable_gradients",
]

DP_NOISE_SIGMAS = (1e-3, 1e-2, 1e-1)
PRUNING_FRACTIONS = (0.5, 0.9, 0.99)


class GaussianNoise(Defence):
    """DAGER's noise defence: add ``sigma * N(0, 1)`` to every element of every trainable gradient.

    ``seed`` fixes the noise stream (tests, reproduction); by default it is a fresh secret.
    """

    def __init__(self, sigma: float, seed: int | None = None) -> None:
        super().__init__()
        if not sigma >= 0:
            raise ValueError(f"sigma={sigma}: must be >= 0")
        self.sigma = float(sigma)
        self.name = f"dp-noise-{self.sigma:g}"
        self._seed = secrets.randbits(62) if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def defend_(self) -> None:
        for p in self._bound().parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                add_noise_(p.grad, self.sigma, self._generator(p.grad.device))

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]


class Pruning(Defence):
    """Gradient pruning: zero exactly ``round(fraction * numel)`` smallest-magnitude entries per tensor."""

    def __init__(self, fraction: float) -> None:
        super().__init__()
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction={fraction}: must lie in [0, 1]")
        self.fraction = float(fraction)
        self.name = f"prune-{self.fraction * 100:g}"

    def defend_(self) -> None:
        for p in self._bound().parameters():
            if p.requires_grad and p.grad is not None:
                prune_(p.grad, self.fraction)


def add_noise_(grad: Tensor, sigma: float, generator: torch.Generator | None = None) -> Tensor:
    """``grad += sigma * N(0, 1)`` in place (noise drawn in fp32, then cast to the gradient's dtype)."""
    if sigma > 0:
        noise = torch.randn(grad.shape, generator=generator, device=grad.device, dtype=torch.float32)
        grad.add_(noise.mul_(sigma).to(grad.dtype))
    return grad


def prune_(grad: Tensor, fraction: float) -> Tensor:
    """Zero the ``round(fraction * numel)`` smallest-|g| entries of ``grad`` in place (ties: any of them)."""
    n = grad.numel()
    k = int(round(fraction * n))
    if k == 0:
        return grad
    if k >= n:
        return grad.zero_()
    flat = grad.view(-1) if grad.is_contiguous() else grad.flatten()
    magnitude = flat.abs()
    # top-k selection is cheaper on the smaller side: find the pruned set or the kept set.
    if k <= n - k:
        flat[torch.topk(magnitude, k, largest=False, sorted=False).indices] = 0
    else:
        keep = torch.topk(magnitude, n - k, largest=True, sorted=False).indices
        kept = flat[keep]
        flat.zero_()
        flat[keep] = kept
    if flat.data_ptr() != grad.data_ptr():
        grad.copy_(flat.view_as(grad))
    return grad


def prune(grads: Mapping[str, Tensor], fraction: float) -> dict[str, Tensor]:
    """Functional pruning of a gradient dict (e.g. one captured at the server)."""
    return {name: prune_(g.detach().clone(), fraction) for name, g in grads.items()}


def add_noise(grads: Mapping[str, Tensor], sigma: float, seed: int | None = None) -> dict[str, Tensor]:
    """Functional DAGER noise on a gradient dict; ``seed`` fixes the stream."""
    gen = torch.Generator().manual_seed(secrets.randbits(62) if seed is None else seed)
    out = {}
    for name, g in grads.items():
        noise = torch.randn(g.shape, generator=gen, dtype=torch.float32) * sigma
        out[name] = g.detach() + noise.to(device=g.device, dtype=g.dtype)
    return out


class Soteria(Defence):
    """Soteria (Sun et al., CVPR 2021) adapted to transformers.

    Original (CNNs): the representation ``r`` is the input of the first fully connected layer; for each
    feature ``f`` the defence measures how much the input ``X`` must move to move ``r_f`` —
    ``||∂r_f/∂X|| / |r_f|`` per sample, summed over the batch — and zeroes the weight-gradient columns of
    the ``fraction`` features with the smallest ratio (they reveal the most about ``X`` per unit of ``r``).
    Every other gradient is shared unchanged.

    Our adaptation: ``X`` is the token-embedding output (the continuous input of a language model) and
    ``r`` the input of the first MLP layer (the first parameter AEGIS's policy classes as ``mlp``: GPT-2
    ``h.0.mlp.c_fc``, BERT ``layer.0.intermediate.dense``, LLaMA ``layers.0.mlp.gate_proj`` — and every
    other MLP weight fed by the same tensor, e.g. LLaMA's ``up_proj``). A sequence has ``T`` rows of ``r``,
    so the per-sample scalar of feature ``f`` is ``s_bf = Σ_t r[b, t, f]``; its ratio is
    ``Σ_b ||∂s_bf/∂X_b|| / (|s_bf| + 0.1)`` (0.1 as in the authors' code). The ``d`` Jacobian rows come
    from batched backward passes through the embedding and first block only (``chunk`` features at a time).
    The pruned slices are the weight gradient's input-feature slices (columns of ``nn.Linear``, rows of
    GPT-2's ``Conv1D``). Soteria does not touch the attention gradients that DAGER reads — by design of
    the original, which protects one layer.
    """

    def __init__(self, fraction: float = 0.8, chunk: int = 64) -> None:
        super().__init__()
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction={fraction}: must lie in [0, 1]")
        self.fraction, self.chunk = float(fraction), int(chunk)
        self.name = f"soteria-{self.fraction * 100:g}"
        # MLP weights of the first block, hooked: (weight name, module, input-feature dim)
        self.candidates: list[tuple[str, nn.Module, int]] = []
        self.targets: list[tuple[str, int]] = []  # (weight name, input dim) fed by r: pruned at the last step
        self.pruned: Tensor | None = None  # feature indices pruned at the last step
        self._hooks: list = []
        self._captured: dict[str, Tensor] = {}

    def _setup(self) -> None:
        from .policy import plan

        model = self._bound()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unknown roles are AEGIS's concern, not Soteria's
            plans = plan(model, AegisConfig(strict=False))
        first = next((p for p in plans if p.role == "mlp" and p.param.dim() == 2 and p.param.requires_grad), None)
        if first is None:
            raise ValueError(f"Soteria: no trainable MLP weight found in {type(model).__name__} to protect")
        parent = first.name.rsplit(".", 2)[0]
        modules = dict(model.named_modules())
        for p in plans:
            owner = p.name.rsplit(".", 1)[0]
            if p.role == "mlp" and p.param.dim() == 2 and p.param.requires_grad and owner.startswith(parent + "."):
                self.candidates.append((p.name, modules[owner], _input_dim(modules[owner], p.name)))
        get_embeddings = getattr(model, "get_input_embeddings", None)  # a Hugging Face model's
        embeddings = get_embeddings() if callable(get_embeddings) else None
        if embeddings is None:
            raise ValueError(f"Soteria: {type(model).__name__} exposes no get_input_embeddings()")
        self._hooks.append(embeddings.register_forward_hook(self._capture_x))
        for name, module, _ in self.candidates:
            self._hooks.append(module.register_forward_pre_hook(self._capture_r(name)))

    def _capture_x(self, module, args, out):
        if "x" in self._captured:
            return None
        if not out.requires_grad:  # frozen embeddings: make X a leaf so ∂r/∂X still exists
            out = out.detach().requires_grad_()
        self._captured["x"] = out
        return out

    def _capture_r(self, name: str):
        def hook(module, args):
            self._captured.setdefault(name, args[0])

        return hook

    def backward(self, batch: Batch, loss_fn: LossFn = lm_loss) -> Tensor:
        model = self._bound()
        self._captured = {}
        loss = loss_fn(model, batch)
        x = self._captured.get("x")
        r = self._captured.get(self.candidates[0][0])
        if x is None or r is None:
            raise RuntimeError("Soteria: the forward pass did not reach the token embeddings and the first MLP layer")
        self.pruned = self._features_to_prune(x, r)
        # Layers fed by the very same tensor as the first one share its features (LLaMA gate/up).
        self.targets = [(n, dim) for n, _, dim in self.candidates if self._captured.get(n) is r]
        self._captured = {}
        loss.backward()
        return loss.detach()

    def _features_to_prune(self, x: Tensor, r: Tensor) -> Tensor:
        d = r.shape[-1]
        k = int(round(self.fraction * d))
        if k == 0:
            return torch.empty(0, dtype=torch.long, device=r.device)
        s = r.detach().float().reshape(r.shape[0], -1, d).sum(1)  # (B, d): per-sample feature sums
        ratio = torch.empty(d, device=r.device)
        for start in range(0, d, self.chunk):
            stop = min(start + self.chunk, d)
            seeds = torch.zeros((stop - start, *r.shape), device=r.device, dtype=r.dtype)
            seeds[torch.arange(stop - start), ..., torch.arange(start, stop)] = 1
            (jac,) = torch.autograd.grad(r, x, grad_outputs=seeds, is_grads_batched=True, retain_graph=True)
            norms = jac.float().flatten(2).norm(dim=2)  # (chunk, B): ||∂s_bf/∂X_b||
            ratio[start:stop] = (norms / (s[:, start:stop].T.abs() + 0.1)).sum(1)
        return torch.topk(ratio, k, largest=False).indices

    def defend_(self) -> None:
        if self.pruned is None:
            raise RuntimeError("Soteria: call backward() before defend_()")
        params = dict(self._bound().named_parameters())
        for name, dim in self.targets:
            grad = params[name].grad
            if grad is not None:
                grad.index_fill_(dim, self.pruned.to(grad.device), 0)

    def report(self) -> dict[str, float]:
        return {"pruned_features": float(0 if self.pruned is None else self.pruned.numel())}

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _input_dim(module: nn.Module, name: str) -> int:
    """Which weight dimension indexes input features: 1 for nn.Linear (out, in), 0 for GPT-2 Conv1D (in, out)."""
    if isinstance(module, nn.Linear):
        return 1
    if type(module).__name__ == "Conv1D":
        return 0
    raise TypeError(f"Soteria: {name} belongs to {type(module).__name__}; only nn.Linear and Conv1D are supported")


class DPSGD(Defence):
    """Opacus DP-SGD: per-sample clipping to ``max_grad_norm``, noise ``noise_multiplier * max_grad_norm``.

    Per-sample gradients come from Opacus's hooks (``GradSampleHooks``, no model wrapping); clipping,
    noise and averaging are Opacus's ``DPOptimizer.pre_step``; ε is Opacus's accountant (``"rdp"`` by
    default) after every defended step, at ``delta``, with ``sample_rate`` = batch size / local data size
    (1.0, the conservative default, when each step sees the client's whole local data). An optimizer
    passed to ``attach`` is left unwrapped: ``defend_`` leaves the DP gradient in ``p.grad`` for it.

    HF GPT-2/BERT build ``position_ids`` of shape [1, T], which Opacus's embedding sampler would read as a
    batch of one (meta-pytorch/opacus#841), so ``backward`` passes ``position_ids`` of shape [B, T] when the
    model takes them. Opacus records activations only in training mode, so the modules that own trainable
    parameters are put in training mode for the forward (dropout modules keep the caller's mode).
    """

    def __init__(
        self,
        max_grad_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        *,
        sample_rate: float = 1.0,
        delta: float = 1e-5,
        accountant: str = "rdp",
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if max_grad_norm <= 0 or noise_multiplier < 0 or not 0 < sample_rate <= 1 or not 0 < delta < 1:
            raise ValueError(
                f"DPSGD(max_grad_norm={max_grad_norm}, noise_multiplier={noise_multiplier}, "
                f"sample_rate={sample_rate}, delta={delta}): need C > 0, z >= 0, 0 < q <= 1, 0 < delta < 1"
            )
        self.max_grad_norm, self.noise_multiplier = float(max_grad_norm), float(noise_multiplier)
        self.sample_rate, self.delta, self.seed = float(sample_rate), float(delta), seed
        self.accountant_name = accountant
        self.name = f"dp-sgd-C{self.max_grad_norm:g}-z{self.noise_multiplier:g}"
        self.steps = 0

    def _setup(self) -> None:
        try:
            from opacus.accountants import create_accountant
            from opacus.grad_sample import GradSampleHooks, register_grad_sampler
            from opacus.optimizers import DPOptimizer
        except ImportError as err:
            raise ImportError("the DP-SGD baseline needs Opacus: pip install 'opacus>=1.6'") from err
        _register_bert_head(register_grad_sampler)
        model = self._bound()
        # Any: Opacus's hooks give the parameters grad_sample / summed_grad attributes
        self._params: list[Any] = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError(f"DP-SGD: {type(model).__name__} has no trainable parameter")
        try:
            self._hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=False)
        except Exception as err:
            raise RuntimeError(f"Opacus cannot compute per-sample gradients for {type(model).__name__}: {err}") from err
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=self._params[0].device).manual_seed(self.seed)
        # DPOptimizer is used for its clip/noise/scale step only; its parameter list is the model's.
        self._dp = DPOptimizer(
            torch.optim.SGD(self._params, lr=0.0),
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=1,
            loss_reduction="mean",
            generator=generator,
        )
        self._accountant = create_accountant(self.accountant_name)
        self._owners = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        self._forward_args = set(inspect.signature(model.forward).parameters)

    def backward(self, batch: Batch, loss_fn: LossFn = lm_loss) -> Tensor:
        model = self._bound()
        batch = dict(batch)
        ids = batch.get("input_ids")
        if ids is not None and "position_ids" in self._forward_args and batch.get("position_ids") is None:
            batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        modes = [m.training for m in self._owners]
        for m in self._owners:
            m.training = True
        try:
            with warnings.catch_warnings():
                # Opacus's full backward hooks on embeddings see integer inputs: expected and harmless.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                loss = loss_fn(model, batch)
                loss.backward()
        except (RuntimeError, ValueError, NotImplementedError) as err:
            raise RuntimeError(f"Opacus DP-SGD failed on {type(model).__name__}: {err}") from err
        finally:
            for m, mode in zip(self._owners, modes):
                m.training = mode
        return loss.detach()

    def defend_(self) -> None:
        model = self._bound()
        missing = [
            n for n, p in model.named_parameters() if p.requires_grad and getattr(p, "grad_sample", None) is None
        ]
        if missing:
            raise RuntimeError(
                f"Opacus produced no per-sample gradient for {missing} of {type(model).__name__}: their "
                "module is one Opacus cannot handle (or they were used outside their module's forward)"
            )
        first = self._params[0].grad_sample
        self._dp.expected_batch_size = (first[0] if isinstance(first, list) else first).shape[0]
        try:
            self._dp.pre_step()
        except (RuntimeError, ValueError) as err:
            raise RuntimeError(f"Opacus DP-SGD failed on {type(model).__name__}: {err}") from err
        for p in self._params:  # one step = one batch: never let per-sample state accumulate
            p.grad_sample = None
            p.summed_grad = None
        self._accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.steps += 1

    @property
    def epsilon(self) -> float:
        """ε spent so far at ``delta`` (infinite without noise, 0 before the first step)."""
        if self.steps == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return float(self._accountant.get_epsilon(delta=self.delta))

    def report(self) -> dict[str, float]:
        return {"epsilon": self.epsilon, "delta": self.delta, "steps": float(self.steps)}

    def detach(self) -> None:
        self._hooks.cleanup()


def _register_bert_head(register) -> None:
    """BERT's LM head (``BertLMPredictionHead``, the default decoder's) owns its vocabulary bias only to hand
    it to its output Linear, whose Opacus sampler gives it its per-sample gradients: the head adds none.
    Opacus's generic fallback would run the head with its tied child and fail."""
    try:
        from transformers.models.bert.modeling_bert import BertLMPredictionHead
    except ImportError:  # without transformers there is no such head
        return
    register(BertLMPredictionHead)(lambda layer, activations, backprops: {})


def make_defence(spec: str | DefenceSpec) -> Defence:
    """A defence from its name (:func:`aegis.registry.parse_defence`): "none", "aegis", "aegis-sentences",
    "dp-noise-0.01", "prune-90", "soteria-80" (or "soteria"), "dp-sgd" or "dp-sgd-C1-z1" (C = clipping
    norm, z = noise multiplier). A name of no defence raises :class:`~aegis.errors.UsageError`."""
    parsed = parse_defence(spec) if isinstance(spec, str) else spec
    core = core_defence(parsed)
    if isinstance(core, Aegis):  # a study measures presets at every batch size, inside their promise or not
        core.config = core.config.replace(allow_outside_promise=True)
    if core is not None:
        return core
    if parsed.kind is DefenceKind.DP_NOISE and parsed.sigma is not None:
        return GaussianNoise(parsed.sigma)
    if parsed.kind is DefenceKind.PRUNE and parsed.share is not None:
        return Pruning(parsed.share)
    if parsed.kind is DefenceKind.SOTERIA and parsed.share is not None:
        return Soteria(parsed.share)
    if parsed.kind is DefenceKind.DP_SGD and parsed.max_grad_norm is not None and parsed.noise_multiplier is not None:
        return DPSGD(parsed.max_grad_norm, parsed.noise_multiplier)
    raise AssertionError(f"{parsed}: a spec parse_defence cannot produce")


def default_baselines() -> list[Defence]:
    """The comparison set of issue 5: DAGER's noise levels, DP-SGD, pruning levels and Soteria."""
    return [
        *(GaussianNoise(s) for s in DP_NOISE_SIGMAS),
        DPSGD(1.0, 1.0),
        *(Pruning(f) for f in PRUNING_FRACTIONS),
        Soteria(0.8),
    ]
