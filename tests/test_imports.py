"""The import picture of ``python/aegis``: no cycles between modules, and no arrow from a lower layer up.

Every import counts, at module level and inside functions (a lazy import is still a dependency). The
layers, lowest first (docs/design.md, "Structure"):

====  ===========  ====================================================================================
rank  layer        modules
====  ===========  ====================================================================================
0     product      config, errors, registry, policy, exposure, accounting, calibration, shield, defence,
                   models, loading, hf, smollm2, data, the package root (``aegis``)
1     comparators  baselines (the defences AEGIS is compared against, behind the product's interface)
2     attacks      attacks.*, metrics
3     federation   fl.* (the Flower client and server; runs a comparator only when one is named)
4     harness      harness.* (what the audit and the utility study share: evaluation, page helpers)
5     audit        audit.*
6     utility      utility.* (the utility study builds on the audit's attacks and options)
7     cli          cli
====  ===========  ====================================================================================

A module may import its own layer (without cycles) and any layer below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "aegis"
KERNELS = Path(__file__).resolve().parents[1] / "aegis_kernels"

LAYERS: dict[str, int] = {
    **dict.fromkeys(
        ("aegis", "config", "errors", "registry", "policy", "exposure", "exposure_store", "exposure_db",
         "exposure_counting", "exposure_decider",
         "exposure_runs", "exposure_files", "ranks", "accounting", "calibration", "coverage",
         "flood", "guard", "shield", "delta", "defence", "models", "loading", "hf", "smollm2", "data"),
        0,
    ),
    "baselines": 1,
    "attacks": 2,
    "delta_attacks": 2,
    "metrics": 2,
    "fl": 3,
    "harness": 4,
    "audit": 5,
    "utility": 6,
    "cli": 7,
}


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("aegis", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "aegis"
    if top not in LAYERS:
        raise AssertionError(f"{module}: not in the layer table of tests/test_imports.py; give it a layer")
    return LAYERS[top]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The package module ``name`` stands for (its longest known prefix), None outside the package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every package module ``module`` imports, wherever the import statement sits."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import sub`` imports the submodule pkg.sub; ``from pkg import name`` imports pkg
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _is_package_parent(source: str, target: str) -> bool:
    # a submodule's import runs its package's __init__ first; a package importing its own submodules is
    # how packages re-export, and a submodule importing its parent package is the same edge reversed
    return target.startswith(source + ".") or source.startswith(target + ".")


def test_the_graph_sees_module_level_and_in_function_imports():
    edges = graph()
    assert "aegis.shield" in edges["aegis.defence"]  # module level
    assert "aegis.baselines" in edges["aegis.fl.rounds"]  # inside a function (the comparator factory)
    assert "aegis.fl" in edges["aegis.audit.runner"]  # inside a function (``from ..fl import run_rounds``)


def test_every_module_has_a_layer():
    for module in modules():
        layer(module)


def test_no_import_cycles():
    edges = {m: {t for t in ts if not _is_package_parent(m, t)} for m, ts in graph().items()}
    assert cycles(edges) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [
        f"{source} (layer {layer(source)}) imports {target} (layer {layer(target)})"
        for source, targets in sorted(graph().items())
        for target in sorted(targets)
        if layer(target) > layer(source)
    ]
    assert upward == []


def test_the_checks_catch_a_cycle_and_an_upward_arrow():
    """The checks themselves: a planted cycle is found, and a product module importing the audit is upward."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("aegis.audit.report") > layer("aegis.shield")
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("helper", ["aegis_kernels.testing", "tests"])
def test_no_package_module_imports_test_helpers(helper):
    """The keyed-randn noise swap is for tests and benchmarks: nothing a client runs may import it."""
    kernels = {f"aegis_kernels/{p.relative_to(KERNELS)}": p for p in KERNELS.rglob("*.py") if p.name != "testing.py"}
    for module, path in {**modules(), **kernels}.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # relative imports inside aegis_kernels: ``from . import testing``
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
                if node.level and module.startswith("aegis_kernels"):
                    names = [f"aegis_kernels.{n}" for n in names]
            else:
                continue
            assert not any(n == helper or n.startswith(helper + ".") for n in names), f"{module} imports {helper}"
