"""The layout's rules, checked over every import statement (module level and inside functions alike).

Rooms, in dependency order: each may import only from itself and the rooms before it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Dependency order. A module belongs to the longest room prefix that matches its dotted name.
ROOMS = (
    "arpo_base",
    "arpo_env",
    "arpo_algo.core",
    "arpo_algo.models",
    "arpo_algo.rollout",
    "arpo_algo.train",
    "arpo_algo.eval",
    "arpo_algo.algorithms",
    "arpo_algo.run",
    "serve",
    "arpo_algo.cli",
    "studies",
    "benchmarks",
    "examples",
)
#: Package-level modules every room may use (version string, package docstring).
SHARED = {"arpo_algo"}
#: The top-level packages the rules cover.
TOPS = ("arpo_base", "arpo_env", "arpo_algo", "serve", "studies", "benchmarks", "examples")
#: Script folders: their code is run by people, never imported by the package or by tests other than their own.
SCRIPT_FOLDERS = ("benchmarks", "studies", "examples", "experiments")
#: The most statements (see :func:`logical_lines`) a module may hold; blank lines, comments and docstrings are free,
#: so a module is never squeezed to fit. 350 statements is the earlier limit of 400 physical code lines at the 1.15 code
#: lines per statement the modules had before the formatter (which spreads long statements over more lines).
MAX_LINES = 350


def _modules() -> dict[str, Path]:
    out = {}
    for top in TOPS:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _room(module: str) -> int | None:
    best = None
    for i, room in enumerate(ROOMS):
        if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(ROOMS[best])):
            best = i
    return best


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """Every imported module name (absolute) with its line, function-level imports included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            # "from pkg import submodule" imports the submodule too
            found += [(f"{name}.{a.name}", node.lineno) for a in node.names]
    return found


def _internal_edges() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for name, _ in _imports(path, mod):
            if name in mods and name != mod:
                edges[mod].add(name)
    return edges


def test_imports_follow_the_room_order():
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        if mod in SHARED:
            continue
        mine = _room(mod)
        if mine is None:
            bad.append(f"{mod}: belongs to no room")
            continue
        for name, line in _imports(path, mod):
            if name in SHARED or not name.startswith(TOPS):
                continue
            theirs = _room(name)
            if theirs is not None and theirs > mine:
                bad.append(
                    f"{path.relative_to(REPO)}:{line} imports {name} ({ROOMS[theirs]} comes after {ROOMS[mine]})"
                )
    assert not bad, "imports against the room order:\n" + "\n".join(bad)


def test_serve_does_not_import_the_training_driver():
    """The server reads checkpoints and models from the rooms below; it never pulls in the training driver (a
    replica would otherwise import the whole run machinery)."""
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for mod, path in _modules().items()
        if mod == "serve" or mod.startswith("serve.")
        for name, line in _imports(path, mod)
        if name == "arpo_algo.run" or name.startswith("arpo_algo.run.")
    ]
    assert not bad, "serve imports from arpo_algo.run:\n" + "\n".join(bad)


def test_no_import_cycles():
    edges = _internal_edges()
    # A package's __init__ re-exporting its own submodules is not a cycle worth reporting: drop parent->child edges.
    for mod in edges:
        edges[mod] = {d for d in edges[mod] if not d.startswith(mod + ".") and not mod.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def logical_lines(source: str) -> int:
    """The statements of ``source`` (Python's logical lines: one per NEWLINE token, however many physical lines the
    formatter gives it), less the module, class and function docstrings. A compound statement's header (``def``,
    ``if``, ``with``) is one; a decorator is one. Counting statements keeps the limit independent of the formatter:
    reformatting a module never moves it across the limit."""
    docstrings = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings += 1
    newlines = sum(tok.type == tokenize.NEWLINE for tok in tokenize.generate_tokens(io.StringIO(source).readline))
    return newlines - docstrings


def test_no_module_over_the_line_limit():
    long = [
        f"{p.relative_to(REPO)}: {n} statements"
        for p in _modules().values()
        if (n := logical_lines(p.read_text(encoding="utf-8"))) > MAX_LINES
    ]
    assert not long, f"modules over {MAX_LINES} statements:\n" + "\n".join(long)


def test_the_line_counter_counts_only_code():
    """Blank lines, comments and docstrings are not counted; statements are, one each however many lines they span,
    a string that is not a docstring included (guards against a vacuous limit)."""
    snippet = '''"""Module docstring,
over two lines."""

# a comment

import os  # a trailing comment keeps its line


class A:
    """Class docstring."""

    x = 1


def f(a,
      b):
    """Function docstring.

    With a paragraph.
    """
    # only a comment
    text = """not a
    docstring"""
    return a + b
'''
    assert logical_lines(snippet) == 6  # import, class, x = 1, def, text = ..., return
    assert logical_lines("") == 0
    one_line = "def f(a, b):\n    return g(a, b, [1, 2, 3])\n"
    spread = "def f(\n    a,\n    b,\n):\n    return g(\n        a,\n        b,\n        [1, 2, 3],\n    )\n"
    assert logical_lines(one_line) == logical_lines(spread) == 2  # the formatter's choice of lines does not count


def test_the_checker_catches_a_backward_import(tmp_path):
    """The rule itself: a core module importing the rollout room is reported (guards against a vacuous check)."""
    assert _room("arpo_algo.core.tree") < _room("arpo_algo.rollout.sampler")
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from arpo_algo.rollout.types import Group\n")
    names = [n for n, _ in _imports(src, "arpo_algo.core.x")]
    assert "arpo_algo.rollout.types" in names


def _test_files() -> list[Path]:
    return sorted((REPO / "tests").rglob("*.py"))


def test_only_a_scripts_own_tests_import_it():
    """The package never depends on benchmarks, studies or examples, and a test imports one only when it is that
    folder's own test (tests/benchmarks/ for benchmarks/, tests/studies/ for studies/)."""
    bad = []
    for path in _test_files():
        rel = path.relative_to(REPO)
        module = ".".join(rel.with_suffix("").parts)
        for name, line in _imports(path, module):
            top = name.split(".")[0]
            if top in SCRIPT_FOLDERS and rel.parts[:2] != ("tests", top):
                bad.append(f"{rel}:{line} imports {name}")
    for mod, path in _modules().items():
        if mod.split(".")[0] in SCRIPT_FOLDERS:
            continue
        bad += [
            f"{path.relative_to(REPO)}:{line} imports {name}"
            for name, line in _imports(path, mod)
            if name.split(".")[0] in SCRIPT_FOLDERS
        ]
    assert not bad, "imports of script folders outside their own tests:\n" + "\n".join(bad)


def test_experiments_holds_experiment_files_in_groups():
    """experiments/ is a library of experiment and sweep files, one group per subfolder, and nothing else."""
    stray = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "experiments").rglob("*")
        if p.is_file()
        and not (p.suffix == ".toml" and p.parent.parent == REPO / "experiments")
        and p != REPO / "experiments" / "README.md"
    ]
    assert not stray, f"not an experiment file in a group folder: {stray}"
    readme = (REPO / "experiments" / "README.md").read_text(encoding="utf-8")
    groups = sorted(p.name for p in (REPO / "experiments").iterdir() if p.is_dir())
    assert groups and all(f"`{g}/`" in readme for g in groups), "experiments/README.md names every group"


@pytest.mark.parametrize("folder", ["benchmarks", "studies"])
def test_every_script_is_listed_in_its_folders_readme(folder):
    """benchmarks/README.md and studies/README.md name every script (as ``python -m folder.name``) and the results
    page it feeds, and every page they name exists."""
    readme = (REPO / folder / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.stem for p in (REPO / folder).glob("*.py") if p.stem != "__init__")
    missing = [s for s in scripts if f"{folder}.{s}" not in readme]
    assert not missing, f"{folder}/README.md does not name {missing}"
    pages = re.findall(r"\(\.\./(docs/[\w/.-]+\.md)", readme)
    assert pages and not [p for p in pages if not (REPO / p).is_file()], "every page named exists"


def _glob_match(rel: str, pattern: str) -> bool:
    """Setuptools' glob: ``*`` matches within one path segment, never across a ``/``."""
    import fnmatch

    parts, pats = rel.split("/"), pattern.split("/")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def test_every_file_the_packages_read_ships_in_a_wheel():
    """A non-Python file inside a package (a page, a script, a stylesheet, a recipe) is read at run time: each must
    match a ``package-data`` pattern, or a non-editable install (a wheel, the GPU image) lacks it."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["*"]
    missing = []
    for top in ("arpo_base", "arpo_env", "arpo_algo", "serve"):
        for path in (REPO / top).rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            # package-data patterns are relative to the folder of the package that holds the file
            package = next(p for p in path.parents if (p / "__init__.py").is_file())
            rel = path.relative_to(package).as_posix()
            if not any(_glob_match(rel, pat) for pat in patterns):
                missing.append(path.relative_to(REPO).as_posix())
    assert not missing, f"not shipped in a wheel (add a pattern to [tool.setuptools.package-data]): {missing}"
