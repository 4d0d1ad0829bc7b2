"""The client's own AEGIS configuration is a floor: the run config (the server's) may tighten it, never relax it.

The server is the adversary (docs/design.md §0), and the run config is its message to every client. Of the
``aegis-*`` keys it may send (:data:`RUN_CONFIG_KEYS`), each is accepted only where it keeps or tightens the
client's own :class:`~aegis.config.AegisConfig`:

* ``aegis-preset``: a preset whose promise stops every threat the client's preset stops (``Promise.stops``
  a superset); a client running its own treatments (a custom mapping) keeps them. Where the asked preset
  promises more exports per example than the client's budget, the client's budget stays.
* ``aegis-strict``: true, or false where the client itself runs ``strict=False``.
* ``aegis-rel-threshold``: at least the client's (a higher threshold lets fewer rows carry signal).
* ``aegis-exposure-budget``: at most the client's budget in force (``AegisConfig.exposures``).
* ``aegis-exposure``: the client's policy; any policy where the client tracks nothing ("off").
* ``aegis-exposure-counts``: ``"across-runs"`` makes a client that counts per run (a simulated one:
  :func:`aegis.config.simulated_client`) keep the machine's counts; ``"per-run"`` only where it already does.

Anything else (a weaker preset, ``strict=false``, a lower threshold, a larger budget, another policy, an
unknown ``aegis-*`` key, ``aegis-seed``) raises ``ValueError`` naming the key, which
:class:`~aegis.fl.client.AegisMod` turns into its constant refusal (the reason stays in the client's log).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import AegisConfig, Preset, preset_from
from ..exposure import IN_MEMORY, ExposurePolicy

PRESET, STRICT, THRESHOLD = "aegis-preset", "aegis-strict", "aegis-rel-threshold"
BUDGET, POLICY, COUNTS = "aegis-exposure-budget", "aegis-exposure", "aegis-exposure-counts"
PER_RUN, ACROSS_RUNS = "per-run", "across-runs"
# run config key -> what the server may ask with it (the error of a refused key quotes it)
RUN_CONFIG_KEYS = {
    PRESET: "a preset that stops at least every threat the client's preset stops",
    STRICT: "true (false only where the client runs strict=False)",
    THRESHOLD: "a rel_threshold at least the client's",
    BUDGET: "an exposure budget at most the client's",
    POLICY: "the client's exposure policy (any, where the client tracks nothing)",
    COUNTS: f'"{ACROSS_RUNS}" (keep the machine\'s counts), or "{PER_RUN}" where the client already counts per run',
}


def config_from_run_config(run_config: Mapping[str, Any], floor: AegisConfig | None = None) -> AegisConfig:
    """``floor`` (the client's own configuration) with the run config's ``aegis-*`` keys applied where they
    keep or tighten it (the module docstring says how); ``ValueError`` / ``TypeError`` naming the key where
    one would relax it or is unknown.

    ``floor=None`` is the server's reading: the defaults with the run config's keys, no floor (the server
    needs the preset to know which parameters train; what a client runs is the client's to decide).
    """
    keys = sorted(k for k in run_config if k.startswith("aegis-"))
    if "aegis-seed" in keys:
        raise ValueError("run config sets 'aegis-seed': AEGIS clients draw secret seeds; a shared seed would let the "
                         "server remove the noise")
    unknown = [k for k in keys if k not in RUN_CONFIG_KEYS]
    if unknown:
        raise ValueError(f"unknown run config key(s) {unknown}: AEGIS reads {sorted(RUN_CONFIG_KEYS)}")
    base = floor if floor is not None else AegisConfig()
    changes: dict[str, Any] = {}
    if PRESET in run_config:
        changes["preset"] = _parse(run_config, PRESET, preset_from)
        if floor is not None:
            _refuse_if(_weaker_preset(changes["preset"], floor.preset), PRESET)
    if STRICT in run_config:
        changes["strict"] = _typed(run_config, STRICT, bool)
        _refuse_if(floor is not None and floor.strict and not changes["strict"]
                   and "the client runs strict=True", STRICT)
    if THRESHOLD in run_config:
        changes["rel_threshold"] = float(_typed(run_config, THRESHOLD, (int, float)))
        _refuse_if(floor is not None and changes["rel_threshold"] < floor.rel_threshold
                   and f"the client's rel_threshold is {floor.rel_threshold}", THRESHOLD)
    if POLICY in run_config:
        changes["exposure"] = _parse(run_config, POLICY, ExposurePolicy)
        _refuse_if(floor is not None and floor.exposure is not ExposurePolicy.OFF
                   and changes["exposure"] is not floor.exposure
                   and f"the client's exposure policy is {floor.exposure.value!r}", POLICY)
    if BUDGET in run_config:
        changes["exposure_budget"] = _typed(run_config, BUDGET, int)
    if COUNTS in run_config and floor is not None:
        changes.update(_counts(str(run_config[COUNTS]), floor))
    try:
        config = base.replace(**changes)
    except ValueError as err:
        raise ValueError(f"run config {sorted(k for k in keys if k != COUNTS)}: {err}") from None
    if floor is not None and config.exposures > floor.exposures:
        _refuse_if(BUDGET in run_config and f"the client's exposure budget is {floor.exposures}", BUDGET)
        config = config.replace(exposure_budget=floor.exposures)  # a stronger preset with a larger default budget
    return config


def _weaker_preset(asked: Preset, own: Preset | str | Mapping) -> str | None:
    if not isinstance(own, Preset):
        return "the client runs its own treatments (a custom preset), which no run config replaces"
    missing = own.promise.stops - asked.promise.stops
    if missing:
        return (f"preset {asked.value!r} does not stop {sorted(str(t) for t in missing)}, which the client's "
                f"preset {own.value!r} stops")
    return None


def _counts(value: str, floor: AegisConfig) -> dict[str, Any]:
    if value not in (PER_RUN, ACROSS_RUNS):
        raise ValueError(f"run config '{COUNTS}' = {value!r}: use \"{ACROSS_RUNS}\" or \"{PER_RUN}\"")
    per_run = floor.exposure_state == IN_MEMORY
    if value == ACROSS_RUNS:
        return {"exposure_state": None} if per_run else {}
    _refuse_if(not per_run and "the client keeps its exposure counts across runs", COUNTS)
    return {}


def _parse(run_config: Mapping[str, Any], key: str, parse) -> Any:
    try:
        return parse(str(run_config[key]))
    except ValueError as err:
        raise ValueError(f"run config '{key}' = {run_config[key]!r}: {err}") from None


def _typed(run_config: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = run_config[key]
    if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
        raise TypeError(f"run config '{key}' = {value!r}: expected {getattr(kind, '__name__', 'a number')}")
    return value


def _refuse_if(reason: str | bool | None, key: str) -> None:
    if reason:
        raise ValueError(f"run config '{key}' would relax this client's own AEGIS configuration ({reason}); "
                         f"a server may ask for {RUN_CONFIG_KEYS[key]}")
