"""One defence registry (aegis.registry): every place a defence is named accepts the same names, builds the same
defence, and refuses a bad name with one message naming the option and the fix."""
from __future__ import annotations

import warnings

import pytest

from aegis.audit.options import AuditConfig, resolve_defence
from aegis.baselines import DPSGD, Aegis, GaussianNoise, NoDefence, Pruning, Soteria, make_defence
from aegis.config import Calibration, Preset
from aegis.defence import core_defence
from aegis.errors import UsageError
from aegis.fl.rounds import _resolve_defence as fl_resolve
from aegis.registry import DefenceKind, DefenceSpec, parse_defence
from aegis.utility.config import UtilityConfig
from aegis.utility.federation import make_defence as utility_defence

GOOD = {
    "none": NoDefence, "Undefended": NoDefence, "aegis": Aegis, "aegis-verification": Aegis,
    "aegis-sentences": Aegis, "aegis-paper": Aegis, "aegis-paper-batch": Aegis, "aegis-sentences-batch": Aegis,
    "dp-noise-0.01": GaussianNoise, "dp-noise-1e-3": GaussianNoise, "dp-sgd": DPSGD, "dp-sgd-C1-z1": DPSGD,
    "dp-sgd-c0.5-z2": DPSGD, "prune-90": Pruning, "prune-0": Pruning, "soteria": Soteria, "soteria-80": Soteria,
}
# (name, what the message must say: the fix)
BAD = [
    ("bogus", "name one such as none, aegis-verification"),
    ("", "name one such as"),
    ("dp-noise", "needs its SIGMA, e.g. dp-noise-0.01"),
    ("dp-noise-nan", "SIGMA must be a number >= 0"),
    ("prune-150", "PERCENT must lie in 0..100, e.g. prune-90"),
    ("prune-abc", "PERCENT must be a number >= 0, e.g. prune-90"),
    ("prune--5", "PERCENT must be a number >= 0"),
    ("soteria-x", "e.g. soteria-90"),
    ("dp-sgd-c0-z1", "C must be > 0, e.g. dp-sgd-C1-z1"),
    ("aegis-best", "use one of ['verification', 'sentences', 'paper', 'reconstruction-delta']"),
    ("aegis-reconstruction", "was removed"),
]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # the paper preset warns that it does not protect: expected here
        warnings.simplefilter("ignore")
        yield


def _sites(name: str) -> dict:
    """Every call site that parses a defence name, each given ``name``."""
    return {
        "defence": lambda: core_defence(name),
        "baselines": lambda: make_defence(name),
        "audit": lambda: AuditConfig.quick(defences=(name,)),
        "utility": lambda: UtilityConfig.quick(defences=(name,)),
        "utility clients": lambda: utility_defence(name),
        "fl": lambda: fl_resolve(name),
    }


@pytest.mark.parametrize("name", GOOD)
def test_every_site_accepts_the_same_names_and_builds_the_same_defence(name):
    for call in _sites(name).values():
        call()  # accepted
    kind = GOOD[name]
    assert type(make_defence(name)) is kind and type(utility_defence(name)) is kind
    core = core_defence(name)
    assert (core is None) == (kind not in (NoDefence, Aegis)) and (core is None or type(core) is kind)
    config, factory = fl_resolve(name)
    assert (config is not None) == (kind is Aegis)  # AEGIS runs under AegisMod, the rest per client
    if kind is Aegis:
        calibration = Calibration.BATCH if name.endswith("-batch") else Calibration.PUBLIC
        built = [make_defence(name).config, utility_defence(name).config, resolve_defence(name).aegis, config]
        assert all(c.calibration is calibration for c in built)
        assert len({c.preset for c in built}) == 1


@pytest.mark.parametrize("name,fix", BAD)
def test_every_site_refuses_a_bad_name_naming_the_option_and_the_fix(name, fix):
    for site, call in _sites(name).items():
        with pytest.raises(UsageError) as err:
            call()
        option = "--defences" if site in ("audit", "utility", "utility clients") else "defence"
        message = str(err.value)
        assert err.value.option == option and message.startswith(f"{option}: "), (site, message)
        assert fix in message, (site, message)


def test_parameters_are_parsed_once_into_the_spec():
    assert parse_defence("DP-SGD-C0.5-Z2") == DefenceSpec("DP-SGD-C0.5-Z2", kind=DefenceKind.DP_SGD,
                                                         max_grad_norm=0.5, noise_multiplier=2.0)
    assert parse_defence(" prune-99 ").share == pytest.approx(0.99)
    assert parse_defence("soteria").share == pytest.approx(0.8)
    assert parse_defence("dp-noise-1e-2").sigma == pytest.approx(0.01)
    spec = parse_defence("aegis-sentences-batch")
    assert spec.kind is DefenceKind.AEGIS and spec.aegis.preset is Preset.SENTENCES
    assert spec.calibration == "batch" and spec.promise is None  # the paper's calibration promises nothing
    assert parse_defence("aegis-sentences").promise is Preset.SENTENCES.promise
    built = make_defence(parse_defence("prune-90"))
    assert isinstance(built, Pruning) and built.fraction == pytest.approx(0.9)


def test_a_spec_carries_an_aegis_config_exactly_when_it_is_aegis():
    with pytest.raises(ValueError, match="parse_defence"):
        DefenceSpec("prune-90")  # a comparator without its parameters
    with pytest.raises(ValueError, match="AegisConfig"):
        DefenceSpec("x", parse_defence("aegis").aegis, kind=DefenceKind.PRUNE)
    assert parse_defence("prune-90").with_aegis(seed=1) == parse_defence("prune-90")
