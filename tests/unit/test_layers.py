"""The import graph of core/, passes/, runtime/ and compiler/ has no cycle.

Layers, bottom up: core (imports none of the others), passes (core), runtime
(core only: the plan and the rules both sides apply, the TP rule tables and the
plan's verification among them, live in core), compiler (any). Within a package no two
modules import each other, directly or around a loop. Imports are read from the
source (every ``import`` statement, also those inside functions), so a cycle
hidden behind a lazy import fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "passes", "runtime", "compiler")
MAY_IMPORT = {
    "core": {"core"},
    "passes": {"core", "passes"},
    "runtime": {"core", "runtime"},
    "compiler": {"core", "passes", "runtime", "compiler"},
}


def _modules() -> dict[str, Path]:
    """Dotted name (``runtime.tp.module``) -> file, for every module of the four layers, subpackages too."""
    return {".".join(f.relative_to(ROOT).with_suffix("").parts): f
            for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py")) if f.stem != "__init__"}


def _imports(path: Path, known: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("partita."):
            base = node.module.removeprefix("partita.")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("partita.") for a in node.names if a.name.startswith("partita.")]
        out |= {n for n in names if n in known or n.split(".")[0] in PACKAGES}
    return out


def import_graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for target in _imports(path, set(mods)):
            if target != name:
                g.add_edge(name, target)
    return g


def upward_imports(g: nx.DiGraph) -> list[str]:
    """Every edge of ``g`` from a layer to one it may not import, as "a imports b"."""
    return [f"{a} imports {b}" for a, b in g.edges if b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]]]


def test_packages_import_only_the_layers_below():
    wrong = upward_imports(import_graph())
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check reads a real file's imports, lazy ones included, and refuses each upward one."""
    src = tmp_path / "m.py"
    src.write_text("from partita.core.plan import Plan\n"
                   "def f():\n    from partita.passes.tp import mesh\n    import partita.compiler.cli\n")
    known = set(_modules())
    g = nx.DiGraph([("runtime.m", b) for b in _imports(src, known)])
    assert sorted(upward_imports(g)) == ["runtime.m imports compiler.cli", "runtime.m imports passes.tp",
                                         "runtime.m imports passes.tp.mesh"]
    g = nx.DiGraph([("core.m", b) for b in _imports(src, known)])
    assert len(upward_imports(g)) == 3


def test_no_module_cycle():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_no_package_cycle():
    g = nx.DiGraph()
    for a, b in import_graph().edges:
        if a.split(".")[0] != b.split(".")[0]:
            g.add_edge(a.split(".")[0], b.split(".")[0])
    assert nx.is_directed_acyclic_graph(g), list(nx.simple_cycles(g))


def test_the_check_sees_a_cycle():
    g = nx.DiGraph([("core.a", "core.b"), ("core.b", "core.a")])
    assert list(nx.simple_cycles(g))
    assert import_graph().number_of_edges() > 50  # it reads the real imports


MAX_LINES = 500


def test_no_product_file_over_500_lines():
    """A file that grows past 500 lines is doing more than one job (issue 14): split it along its seams."""
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, ", ".join(f"{k}: {v} lines" for k, v in sorted(long.items()))
