"""The code's own documentation stays short and points at files that exist.

A module docstring says what the module owns in a few lines; the long explanations
live in docs/ and are linked (STYLE.md). So every module docstring of the package is
at most ``MAX_DOCSTRING_LINES`` lines, and every file path that a docstring or comment
of the package, README.md or docs/*.md cites names a file of this repository: a file
that moved leaves no stale pointer behind.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import io
import os
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "passes", "runtime", "compiler", "partita")
MAX_DOCSTRING_LINES = 40

# A cited path: segments of name characters joined by "/", ending in .py or .md, not part of
# a longer word or path (so ``cost_model.zero_collectives`` and URLs' tails are not paths).
PATH = re.compile(r"(?<![\w./*-])((?:\.\./)*(?:[\w*.-]+/)*[\w*-][\w*.-]*\.(?:py|md))(?![\w/-])")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Names the docs use for a user's own file, not a file of the repository.
EXAMPLE_NAMES = {"FILE.py", "train.py", "bad_model.py"}
# Outside the repository (the workspace folder beside it): not shipped, so not citable.
OUTSIDE = ("shared/", "../")
SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "node_modules"}


def _sources() -> list[Path]:
    return [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))
            if not SKIP_DIRS & set(f.relative_to(ROOT).parts)]


@functools.cache
def repo_files() -> tuple[str, ...]:
    """Every file of the checkout, relative to the root (build outputs and caches left out)."""
    out = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [(Path(folder) / n).relative_to(ROOT).as_posix() for n in names]
    return tuple(out)


def docstring_lines(path: Path) -> int:
    """Source lines of the module docstring, opening and closing quotes included (0: none)."""
    body = ast.parse(path.read_text()).body
    if body and _is_docstring(body[0]):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def prose_of_python(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function) and comment of a Python file."""
    src = path.read_text()
    out = [(node.body[0].lineno, node.body[0].value.value) for node in ast.walk(ast.parse(src))
           if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
           and node.body and _is_docstring(node.body[0])]
    out += [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type == tokenize.COMMENT]
    return out


def _exists(path: str, base: Path) -> bool:
    """Whether ``path`` (relative to ``base``) names a file of the repository: a bare file name
    must be some repository file's name (or one of ``EXAMPLE_NAMES``); ``*`` globs."""
    files = repo_files()
    if "/" not in path:
        return path in EXAMPLE_NAMES or any(fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], path) for f in files)
    target = (base / path).resolve()
    if not target.is_relative_to(ROOT):
        return False
    rel = target.relative_to(ROOT).as_posix()
    return any(fnmatch.fnmatchcase(f, rel) for f in files) if "*" in rel else target.exists()


def stale_paths(where: str, text: str, base: Path = ROOT, markdown: bool = False) -> list[str]:
    """The cited paths of ``text`` that name no repository file, as "where: path". Markdown link
    targets resolve from ``base`` (the Markdown file's folder), every other path from the root;
    a path under a folder the repository does not have (``torch/_export/...``) is another
    project's and is left alone."""
    bad = []
    text = URL.sub(" ", text)
    if markdown:
        for target in MD_LINK.findall(text):
            target = target.split("#")[0]
            if target and not _exists(target, base):
                bad.append(f"{where}: link {target}")
        text = MD_LINK.sub("]", text)
    tops = {f.split("/")[0] for f in repo_files()}
    for path in PATH.findall(text):
        if path.startswith(OUTSIDE):
            bad.append(f"{where}: {path} (outside the repository)")
        elif "/" in path and path.split("/")[0] not in tops:
            continue
        elif not _exists(path, ROOT):
            bad.append(f"{where}: {path}")
    return bad


def test_module_docstrings_are_short():
    """Every module docstring of the package says what the module owns in at most 40 lines."""
    over = {f.relative_to(ROOT).as_posix(): n for f in _sources() if (n := docstring_lines(f)) > MAX_DOCSTRING_LINES}
    assert not over, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the explanation to docs/ "
                      f"and link it): {over}")


def test_cited_files_exist():
    """A file path cited in the package's docstrings and comments, README.md or docs/*.md exists."""
    bad = []
    for f in _sources():
        rel = f.relative_to(ROOT).as_posix()
        for line, text in prose_of_python(f):
            bad += stale_paths(f"{rel}:{line}", text)
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        bad += stale_paths(md.relative_to(ROOT).as_posix(), md.read_text(), md.parent, markdown=True)
    assert not bad, "cited files that do not exist:\n" + "\n".join(bad)


def test_the_path_check_catches_what_it_should_and_nothing_else():
    """The checker flags a moved module, a bare stale name, a sibling-folder citation and a broken
    link, and leaves URLs, dotted names, other projects' paths and example names alone."""
    def check(text: str, markdown: bool = False) -> list[str]:
        return stale_paths("x", text, markdown=markdown)

    assert check("see passes/pipeline_explain.py and runtime/tp_interpreter.py") == [
        "x: passes/pipeline_explain.py", "x: runtime/tp_interpreter.py"]
    assert check("the rule in tp_costs.py") == ["x: tp_costs.py"]
    assert check("figures from shared/REFERENCE.md") == ["x: shared/REFERENCE.md (outside the repository)"]
    assert check("[the figures](../shared/REFERENCE.md)", markdown=True) == ["x: link ../shared/REFERENCE.md"]
    assert check("[a moved page](docs/cost_model.md)", markdown=True) == ["x: link docs/cost_model.md"]
    assert check("[the cost model](docs/cost-model.md), runtime/dp/zero.py, tests/unit/test_docs.py, "
                 "tests/*_worker.py, docs/*.md, zero.py", markdown=True) == []
    assert check("https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md, "
                 "cost_model.zero_collectives, passes/dp/zero.zero_stages, torch/_export/non_strict_utils.py, "
                 "`partita compile FILE.py:NAME`, partita run plan.json train.py") == []
