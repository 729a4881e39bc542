"""The import graph of core/, passes/, runtime/ and compiler/ has no cycle.

Layers, bottom up: core (imports none of the others), passes (core), runtime
(core only: the plan and the rules both sides apply, the TP rule tables and the
plan's verification among them, live in core), compiler (any). Within a package no two
modules import each other, directly or around a loop. Imports are read from the
source (every ``import`` statement, also those inside functions), so a cycle
hidden behind a lazy import fails too.

Each name is imported from its home: no module of the four layers imports a name
only so that others can import it from there (a re-export shim, issue 41); and no
product file grows past 500 lines.
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
    src.write_text("from partita.core.plans.plan import Plan\n"
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


# every file that may import from the product: the layers, the public package, tests, benchmarks, examples, docs
MAX_MODULES = 15  # a folder holding more is split into subpackages at its seams (issue 41)


def crowded_folders(root: Path) -> list[str]:
    """Product folders holding more than ``MAX_MODULES`` Python modules of their own (``__init__`` counted)."""
    out = []
    for package in PACKAGES:
        for folder in [root / package, *(p for p in (root / package).rglob("*") if p.is_dir())]:
            modules = [p for p in folder.glob("*.py")]
            if "__pycache__" not in folder.parts and len(modules) > MAX_MODULES:
                out.append(f"{folder.relative_to(root)}: {len(modules)} modules")
    return out


def test_no_flat_folder_over_15_modules():
    assert not crowded_folders(ROOT)


def test_the_check_sees_a_crowded_folder(tmp_path):
    (tmp_path / "core" / "sub").mkdir(parents=True)
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    for i in range(MAX_MODULES + 1):
        (tmp_path / "core" / "sub" / f"m{i}.py").write_text("")
    assert crowded_folders(tmp_path) == [f"core/sub: {MAX_MODULES + 1} modules"]


IMPORTERS = (*PACKAGES, "partita", "tests", "benchmarks", "examples", "docs")


def _product_modules() -> dict[str, Path]:
    """``_modules`` with the packages' ``__init__`` files, each under its package's dotted name."""
    inits = {".".join(f.relative_to(ROOT).parent.parts): f
             for pkg in PACKAGES for f in (ROOT / pkg).rglob("__init__.py")}
    return {**_modules(), **inits}


def _unused_imports(path: Path) -> dict[str, str]:
    """Names ``path`` binds with ``from M import name`` and never reads -> M. A name listed in
    ``__all__`` only is unused: a string is no use."""
    tree = ast.parse(path.read_text())
    bound = {a.asname or a.name: node.module or "." for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) for a in node.names}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return {name: home for name, home in bound.items() if name not in read}


def re_export_shims(modules: dict[str, Path], importers: list[Path], root: Path = ROOT) -> list[str]:
    """Every name a module of ``modules`` imports and never uses while a file of ``importers`` imports
    it from there, as "core.plan re-exports MeshAxis (from partita.core.mesh) to tests/x.py"."""
    unused = {name: _unused_imports(path) for name, path in modules.items()}
    found = []
    for path in importers:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("partita."):
                module = node.module.removeprefix("partita.")
                found += [f"{module} re-exports {a.name} (from {unused[module][a.name]}) to {path.relative_to(root)}"
                          for a in node.names if a.name in unused.get(module, {})]
    return sorted(found)


def test_no_re_export_shims():
    """Import a name from its home: a module that imports a name it never uses, so that others can
    import it from there, keeps an old import path alive and hides where the name lives."""
    importers = [f for d in IMPORTERS for f in sorted((ROOT / d).rglob("*.py"))]
    shims = re_export_shims(_product_modules(), importers)
    assert not shims, "\n".join(shims)


def test_the_check_sees_a_re_export_shim(tmp_path):
    """A name imported and never used (kept by a ``noqa`` or an ``__all__``) that another file imports
    from there is a shim, lazy imports included; a name the module uses is not, nor an unused one
    nobody imports from it."""
    shim = tmp_path / "shim.py"
    shim.write_text("from partita.core.mesh import Mesh, MeshAxis  # noqa: F401\n"
                    "from partita.core.plans.plan import Plan  # noqa: F401\n__all__ = ['MeshAxis']\n"
                    "def world(m: Mesh) -> int:\n    return m.world_size\n")
    user = tmp_path / "user.py"
    user.write_text("from partita.core.shim import Mesh, world\n"
                    "def f():\n    from partita.core.shim import MeshAxis\n")
    assert re_export_shims({"core.shim": shim}, [user], root=tmp_path) == [
        "core.shim re-exports MeshAxis (from partita.core.mesh) to user.py"]
    assert re_export_shims(_product_modules(), [user], root=tmp_path) == []  # no partita.core.shim


# ParallelModel composes the runtime's parts (issue 41): a short class that asks no part whether it is there
COMPOSITION_MAX_LINES = 150
# the program's parts a plan may leave out: reading one is where an ``is None`` branch on it begins
OPTIONAL_PARTS = {"pipeline", "zero", "averager", "dp_group", "scaler", "master", "buffers"}


def part_dispatch(source: str, cls: str = "ParallelModel") -> list[str]:
    """Where class ``cls`` of ``source`` decides what to run by whether a part is there, as "line N:
    code": every ``is None`` / ``is not None`` test but of a method's own arguments (``options if
    options is not None``), and every read of a part a plan may leave out (``p.zero``)."""
    tree = ast.parse(source)
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    found = []
    for method in [n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.Lambda))]:
        own = {a.arg for a in [*method.args.posonlyargs, *method.args.args, *method.args.kwonlyargs]}
        for n in ast.walk(method):
            if isinstance(n, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops):
                sides = [n.left, *n.comparators]
                if any(isinstance(s, ast.Constant) and s.value is None for s in sides) and not any(
                        isinstance(s, ast.Name) and s.id in own for s in sides):
                    found.append(f"line {n.lineno}: {ast.unparse(n)}")
    found += [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(node)
              if isinstance(n, ast.Attribute) and n.attr in OPTIONAL_PARTS]
    return sorted(set(found))


def class_lines(source: str, cls: str = "ParallelModel") -> int:
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls]
    return node.end_lineno - node.lineno + 1


def test_parallel_model_is_a_short_composition_of_parts():
    """``ParallelModel`` composes the program, the training step, checkpoints and reports, each a part
    with its own interface (runtime/step/, runtime/state/checkpoints.py): the choice between a pipeline
    and one stage, data parallelism and ZeRO, fp16 and the rest is made once, by compose, not by an
    ``is None`` branch in the class."""
    source = (ROOT / "runtime" / "engine.py").read_text()
    assert class_lines(source) < COMPOSITION_MAX_LINES
    dispatch = part_dispatch(source)
    assert not dispatch, "\n".join(dispatch)


def test_the_check_sees_a_branch_on_a_part():
    """A test of a part, directly or through a name it was read into, is found, and so is a read of an
    optional part; a test of the method's own argument is not."""
    source = ("class ParallelModel:\n"
              "    def __init__(self, options=None):\n"
              "        self.options = options if options is not None else {}\n"
              "    def forward(self, x):\n"
              "        if self._program.pipeline is None:\n"
              "            return x\n"
              "        zero = self.parts[0]\n"
              "        return x if zero is not None else -x\n"
              "    def step(self):\n"
              "        return self._program.sync.step()\n")
    assert part_dispatch(source) == ["line 5: self._program.pipeline", "line 5: self._program.pipeline is None",
                                     "line 8: zero is not None"]
    assert class_lines(source) == 10
