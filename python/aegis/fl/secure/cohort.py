"""Many LoRA clients trained at once on one frozen base model: the clients of a delta-mode shortcut round.

Client c holds its own adapters (A_c, B_c) on every adapted Linear, all starting from the global ones, and
the Linear's output for client c's rows is ``base(x) + s B_c A_c x`` (peft's LoRA with dropout 0,
s = lora_alpha / r). Stacking the clients' rows (every client the same number of sequences per step, the
sequences right-padded to one length: causal attention never reads a later pad) and their adapters
((C, r, d_in) and (C, d_out, r)) runs C clients' local training as one forward and one backward per step.
The loss is the sum over clients of each client's own mean token loss, so client c's adapters receive
exactly its own gradient; AdamW and SGD act element-wise, and every client takes the same steps, so one
optimizer over the stacked adapters is C independent ones. ``tests/test_secure_delta.py`` checks the deltas
against :class:`aegis.delta.DeltaShield` clients on peft models.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from ...defence import Batch

LORA_A, LORA_B = ".lora_A.default.weight", ".lora_B.default.weight"
PEFT_PREFIX = "base_model.model."
Optimizer = Callable[[list[Tensor]], torch.optim.Optimizer]


class _CohortLinear(nn.Module):
    """A frozen Linear plus one LoRA adapter per client; ``a``, ``b`` are set per training call."""

    def __init__(self, base: nn.Linear, scale: float) -> None:
        super().__init__()
        self.base, self.scale = base, scale
        self.a: Tensor | None = None  # (C, r, d_in)
        self.b: Tensor | None = None  # (C, d_out, r)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        if self.a is None or self.b is None:
            return out
        rows = x.reshape(self.a.shape[0], -1, x.shape[-1])  # the batch is C equal client blocks
        low = torch.bmm(rows, self.a.transpose(1, 2))
        return out + self.scale * torch.bmm(low, self.b.transpose(1, 2)).reshape(out.shape)


def lora_state(model: nn.Module) -> dict[str, Tensor]:
    """Every peft LoRA factor of ``model`` (``...lora_A.default.weight`` / ``...lora_B.default.weight``), copied."""
    state = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith((LORA_A, LORA_B))}
    if not state:
        raise ValueError("no peft LoRA adapters (…lora_A.default.weight) in the model: wrap it with "
                         "peft.get_peft_model(model, peft.LoraConfig(...)) first")
    return state


class Cohort:
    """C LoRA clients of one base model (module docstring). Adapter tensors are named as in the peft model."""

    def __init__(self, model: nn.Module, names: Sequence[str], scale: float) -> None:
        """``model``: the plain base model (copied and frozen); ``names``: the peft LoRA factor names to
        train; ``scale``: lora_alpha / r."""
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.names = list(names)
        self.layers: dict[str, _CohortLinear] = {}
        for path in dict.fromkeys(_module_path(n) for n in self.names):
            parent_path, _, child = path.rpartition(".")
            parent = self.model.get_submodule(parent_path)
            base = getattr(parent, child)
            if not isinstance(base, nn.Linear):
                raise TypeError(f"{path}: a cohort adapts nn.Linear modules only, found {type(base).__name__}")
            layer = _CohortLinear(base, scale)
            setattr(parent, child, layer)
            self.layers[path] = layer

    @classmethod
    def from_peft(cls, peft_model: nn.Module) -> Cohort:
        """The cohort of a peft LoRA model (dropout 0, one scaling for every adapter)."""
        names = list(lora_state(peft_model))
        scalings = [getattr(m, "scaling", None) for m in peft_model.modules()]
        scales = {float(s) for scaling in scalings if isinstance(scaling, dict) for s in scaling.values()}
        dropouts = [n for n, m in peft_model.named_modules()
                    if ".lora_dropout." in n and not isinstance(m, nn.Identity)]
        if len(scales) != 1 or dropouts:
            raise ValueError("Cohort.from_peft: one LoRA scaling for every adapter and lora_dropout=0 (the clients' "
                             "training must be deterministic and alike)")
        unload = cast(Callable[[], nn.Module], copy.deepcopy(peft_model).unload)  # peft: the base, adapters dropped
        return cls(unload(), names, scales.pop())

    def train(self, start: Mapping[str, Tensor], clients: Sequence[Sequence[Batch]], *, epochs: int,
              optimizer: Optimizer, chunk: int | None = None) -> dict[str, Tensor]:
        """Each client's delta after ``epochs`` passes over its batches (in order) from ``start``, a fresh
        ``optimizer(params)`` per chunk of at most ``chunk`` clients: {name: (C, *shape)}."""
        if not clients:
            raise ValueError("Cohort.train: no clients")
        if epochs < 1:
            raise ValueError(f"epochs={epochs}: train at least one local epoch")
        steps = {len(c) for c in clients}
        sizes = {tuple(len(b["input_ids"]) for b in c) for c in clients}
        if len(steps) != 1 or len(sizes) != 1 or not next(iter(sizes)):
            raise ValueError("Cohort.train: every client needs the same number of batches with the same number of "
                             "sequences each (one batched step per local step)")
        chunk = chunk or len(clients)
        parts = [self._train_chunk(start, clients[i:i + chunk], epochs, optimizer)
                 for i in range(0, len(clients), chunk)]
        return {n: torch.cat([p[n] for p in parts]) for n in self.names}

    def _train_chunk(self, start, clients, epochs, optimizer) -> dict[str, Tensor]:
        c = len(clients)
        device = next(self.model.parameters()).device
        params = {n: start[n].to(device).unsqueeze(0).repeat(c, *([1] * start[n].dim())).requires_grad_()
                  for n in self.names}
        for path, layer in self.layers.items():
            layer.a, layer.b = params[f"{PEFT_PREFIX}{path}{LORA_A}"], params[f"{PEFT_PREFIX}{path}{LORA_B}"]
        opt = optimizer(list(params.values()))
        try:
            with torch.enable_grad():
                for _ in range(epochs):
                    for j in range(len(clients[0])):
                        batch = _stack([client[j] for client in clients], device)
                        _cohort_loss(self.model, batch, c).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
        finally:
            for layer in self.layers.values():
                layer.a = layer.b = None
        return {n: (p.detach() - start[n].to(device)) for n, p in params.items()}


def _module_path(name: str) -> str:
    if not name.startswith(PEFT_PREFIX) or not name.endswith((LORA_A, LORA_B)):
        raise ValueError(f"{name}: not a peft LoRA factor name ({PEFT_PREFIX}<module>{LORA_A})")
    return name.removeprefix(PEFT_PREFIX).removesuffix(LORA_A).removesuffix(LORA_B)


def _stack(batches: Sequence[Batch], device: torch.device) -> dict[str, Tensor]:
    """The clients' batches as one, right-padded to the longest (pads masked, labels -100)."""
    length = max(b["input_ids"].shape[1] for b in batches)

    def pad(x: Tensor, value: int) -> Tensor:
        return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)

    out = {"input_ids": torch.cat([pad(b["input_ids"], 0) for b in batches]),
           "attention_mask": torch.cat([pad(b["attention_mask"], 0) for b in batches]),
           "labels": torch.cat([pad(b["labels"], -100) for b in batches])}
    return {k: v.to(device) for k, v in out.items()}


def _cohort_loss(model: nn.Module, batch: Mapping[str, Tensor], clients: int) -> Tensor:
    """Sum over the clients of each one's mean next-token loss (the HF causal-LM loss of its own rows)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100,
                                            reduction="none")
    per_client = nll.reshape(clients, -1).sum(1) / (labels != -100).reshape(clients, -1).sum(1).clamp_min(1)
    return per_client.sum()
