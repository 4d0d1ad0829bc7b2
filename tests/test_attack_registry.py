"""One list of attack names (aegis.attacks.registry) that the audit, the utility study and the benchmarks read,
and one place that builds an attack's function."""
from __future__ import annotations

import subprocess
import sys

import pytest

from aegis.attacks import registry
from aegis.errors import UsageError


def test_every_name_builds_and_every_list_comes_from_the_registry():
    import aegis.attacks as attacks
    from aegis.audit import attacks as audit_attacks
    from aegis.audit.options import ATTACKS, DEFAULT_ATTACKS
    from aegis.audit.records import THREATS
    from aegis.config import Threat
    from aegis.utility import config as utility_config
    from aegis.utility import privacy

    assert ATTACKS == registry.NAMES and set(DEFAULT_ATTACKS) <= set(ATTACKS)
    assert set(THREATS) == set(registry.NAMES) and all(isinstance(t, Threat) for t in THREATS.values())
    assert set(utility_config.ATTACKS) <= set(ATTACKS) and set(privacy.DEFAULT_ATTACKS) <= set(utility_config.ATTACKS)
    for name in registry.TEXT:
        fn = registry.text_attack(name)
        assert callable(fn) and fn is getattr(attacks, name) and fn.__name__ == name
    for name in registry.NAMES:
        assert audit_attacks.make(name).name == name


def test_unknown_names_get_a_suggestion():
    with pytest.raises(UsageError, match=r"--attacks: unknown 'dagr'; did you mean 'dager'\?"):
        registry.attack("dagr", "--attacks")
    with pytest.raises(UsageError, match="not a text attack"):
        registry.text_attack("labels")


def test_a_function_keeps_its_name_after_its_module_loads_first():
    """`aegis.attacks.dager` is the function even when the submodule `aegis.attacks.dager` loaded first (as
    when spectral, which imports it, is imported before anything asks for the function)."""
    code = ("import aegis.attacks.spectral\nimport aegis.attacks as a\nfrom aegis.attacks import dager, mlp_span\n"
            "assert callable(dager) and callable(mlp_span) and callable(a.spectral) and a.tag.__name__ == 'tag'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
