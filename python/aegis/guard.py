"""One shield per model and optimizer: a second would flood the gradients twice. Entries hold weak references,
so a shield nobody holds is collected with its hooks and the model may be protected again."""
from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch
from torch import nn


def weakly(method: Callable) -> Callable:
    """``method`` called through a weak reference to its object (None once that is collected)."""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> object:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()



# Live shields by id of the parameters and optimizers they guard (a second shield would flood twice); each
# entry keeps weak references to the object and its shield, so a copy of a model is not guarded.
_GUARDED: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _guard_of(obj: object) -> object | None:
    entry = _GUARDED.get(id(obj))
    if entry is None or entry[0]() is not obj:
        return None
    return entry[1]()


def refuse_second_shield(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    if any(_guard_of(obj) is not None for obj in [*model.parameters(), optimizer] if obj is not None):
        gc.collect()  # a shield nobody holds may still sit in a reference cycle
    for obj, what in [*((p, f"parameter {n}") for n, p in model.named_parameters()), (optimizer, "optimizer")]:
        shield = _guard_of(obj) if obj is not None else None
        if shield is not None:
            raise ValueError(
                f"protect(): the {what} is already protected by {shield!r} (its optimizer hook would flood "
                "the gradients a second time): use that shield, or call its remove() before protecting again"
            )


def register(shield: object, params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> None:
    for key, entry in list(_GUARDED.items()):  # forget collected objects
        if entry[0]() is None or entry[1]() is None:
            del _GUARDED[key]
    held = weakref.ref(shield)
    for obj in [*params, *([optimizer] if optimizer is not None else [])]:
        _GUARDED[id(obj)] = (weakref.ref(obj), held)


def unregister(shield: object) -> None:
    for key, entry in list(_GUARDED.items()):
        if entry[1]() is shield:
            del _GUARDED[key]


def drop_from_optimizer(optimizer: torch.optim.Optimizer, frozen: list[nn.Parameter]) -> None:
    """Frozen parameters leave the optimizer so weight decay or momentum cannot move them."""
    ids = {id(p) for p in frozen}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    for p in frozen:
        optimizer.state.pop(p, None)
