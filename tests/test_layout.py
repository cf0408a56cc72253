"""The layout's rules, checked over every import (module level and inside functions alike, dynamic ones included).

Rooms, in dependency order: each may import only from itself and the rooms before it. An import is an ``import`` or
``from`` statement, or a module loaded by name: ``importlib.import_module("x")``, ``__import__("x")``,
``importlib.util.find_spec("x")``, ``pkgutil.resolve_name("x:y")``, ``python -m x`` in an argument list, and any string
that names a module of the project in the dotted or ``"module:attr"`` form (a Ray ``runtime_env`` or Serve import path,
an entry-point value), since such a string exists to be loaded.
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
    "arpo_algo.cli",
    "serve",
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


def _modules(root: Path = REPO) -> dict[str, Path]:
    out = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
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


#: Calls that load the module their first argument names.
LOADERS = {"import_module", "__import__", "find_spec", "resolve_name"}
#: A string that names a module (dotted, at least two parts) or a ``module:attr`` target.
_MODULE_STRING = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+(?::[\w.]+)?|[A-Za-z_]\w*:[\w.]+")


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _dynamic_imports(tree: ast.AST, package: str, runs: bool) -> list[tuple[str, int]]:
    """Modules loaded by name: a loader call's first argument, any string of the project's module forms
    (``logging.getLogger``'s argument, a logger's name, excepted) and, with ``runs``, the module after ``-m`` in a
    list or tuple (a child process that runs it)."""
    found, seen = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            arg = node.args[0]
            if _call_name(node) == "getLogger":
                seen.add(id(arg))
            elif _call_name(node) in LOADERS and isinstance(arg.value, str):
                name = arg.value.partition(":")[0]
                if name.startswith("."):  # import_module(".x", package): relative to the caller's package
                    name = package + name
                found.append((name, node.lineno))
                seen.add(id(arg))
        elif isinstance(node, (ast.List, ast.Tuple)):
            for flag, word in zip(node.elts, node.elts[1:]):
                if isinstance(flag, ast.Constant) and flag.value == "-m" and isinstance(word, ast.Constant):
                    seen.add(id(word))
                    if runs and isinstance(word.value, str):
                        found.append((word.value, word.lineno))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in seen
            and _MODULE_STRING.fullmatch(node.value)
            and node.value.split(".")[0].partition(":")[0] in TOPS
        ):
            found.append((node.value.partition(":")[0], node.lineno))
    return found


def _imports(path: Path, module: str, runs: bool = True) -> list[tuple[str, int]]:
    """Every imported module name (absolute) with its line, function-level and dynamic imports included; ``runs``
    counts a module a child process runs (``python -m x``) as well."""
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
    return found + _dynamic_imports(tree, package, runs)


def _internal_edges(root: Path = REPO) -> dict[str, set[str]]:
    """``{module: the project's modules it imports}``; a name below a module (``pkg.mod.attr``) is that module."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for name, _ in _imports(path, mod):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
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


def _components(edges: dict[str, set[str]], members: set[str]) -> list[list[str]]:
    """The strongly connected components of ``edges`` restricted to ``members`` that hold a cycle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in sorted(edges[m] & members):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                component.append(stack.pop())
                if component[-1] == m:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for m in sorted(members):
        if m not in index:
            visit(m)
    return out


def _cycles(edges: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """The import circles, as groups of modules that import each other round, with one exemption: a package's
    ``__init__`` re-exporting its own submodules while they import names from it. A group all of whose modules lie
    inside one package that is itself in the group is exempt for the cycles through that ``__init__``; its other
    modules are checked again without it, so a circle among a package's submodules (or one that passes through a
    sub-package's ``__init__`` to modules outside that sub-package) is still reported."""
    found = []
    pending = [set(edges)]
    while pending:
        for component in _components(edges, pending.pop()):
            roots = [p for p in component if p in packages and all(m == p or m.startswith(p + ".") for m in component)]
            if roots:
                pending.append(set(component) - set(roots))
            else:
                found.append(component)
    return sorted(found)


def _packages(root: Path = REPO) -> set[str]:
    return {m for m, p in _modules(root).items() if p.name == "__init__.py"}


def _circle(edges: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, as the import path that leads back to it."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop(0)
        for d in sorted(edges[m] & inside):
            if d == start:
                return paths[m] + [start]
            if d not in paths:
                paths[d] = paths[m] + [d]
                todo.append(d)
    return component  # not reached: a component with a cycle leads back to each of its modules


def test_no_import_cycles():
    edges = _internal_edges()
    cycles = _cycles(edges, _packages())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(_circle(edges, c)) for c in cycles)


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


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_counts_imports_by_name(tmp_path):
    """Modules loaded by name are imports: a backward ``importlib.import_module``, ``__import__``, ``find_spec``, a
    ``"module:attr"`` import path and ``python -m`` are all found; a logger's dotted name is not."""
    assert _room("arpo_algo.core.tree") < _room("arpo_algo.rollout.sampler") < _room("serve.app")
    src = tmp_path / "x.py"
    src.write_text(
        "import importlib\nimport logging\n\n\n"
        "def f():\n"
        '    importlib.import_module("arpo_algo.rollout.sampler")\n'
        '    __import__("arpo_algo.train")\n'
        '    importlib.util.find_spec("arpo_algo.eval.trees")\n'
        '    return {"import_path": "serve.app:build", "argv": ["python", "-m", "serve"]}\n\n\n'
        'log = logging.getLogger("arpo_algo.run.driver")\n'
    )
    names = [n for n, _ in _imports(src, "arpo_algo.core.x") if n.startswith(TOPS)]
    assert names == ["arpo_algo.rollout.sampler", "arpo_algo.train", "arpo_algo.eval.trees", "serve", "serve.app"]
    assert "arpo_algo.run.driver" not in names


def test_the_cycle_check_sees_through_an_init(tmp_path):
    """A circle that passes from a package's ``__init__`` into its submodules and out of the package is reported
    (the old check dropped every parent-child edge and missed it); a package's ``__init__`` re-exporting a submodule
    that imports a name from it is not."""
    _plant(
        tmp_path,
        {
            "arpo_env/__init__.py": "",
            "arpo_env/core.py": "from arpo_env.session import Session\n",
            "arpo_env/session.py": "def make():\n    from arpo_env.tools import build\n",
            "arpo_env/tools/__init__.py": "from arpo_env.tools.checks import check\n\nbuild = check\n",
            "arpo_env/tools/checks.py": "def check():\n    from arpo_env.core import DEFAULTS\n",
            "arpo_env/store/__init__.py": "LIMIT = 3\nfrom arpo_env.store.disk import Disk\n",
            "arpo_env/store/disk.py": "from arpo_env.store import LIMIT\n",
        },
    )
    edges = _internal_edges(tmp_path)
    assert "arpo_env.tools.checks" in edges["arpo_env.tools"]  # the __init__ -> own submodule edge is kept
    cycles = _cycles(edges, _packages(tmp_path))
    assert cycles == [["arpo_env.core", "arpo_env.session", "arpo_env.tools", "arpo_env.tools.checks"]]
    circle = _circle(edges, cycles[0])
    assert circle[0] == circle[-1] == "arpo_env.core" and len(circle) == 5


def test_the_commands_other_rooms_add_come_from_later_rooms():
    """``arpo`` finds the server's commands through the ``arpo.commands`` entry points: each names a module (with a
    ``register`` function) of a room after the command line's, whose own commands are its built-ins."""
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["arpo.commands"]
    assert declared, "the server's commands are declared"
    mods = _modules()
    for name, target in declared.items():
        module = target.partition(":")[0]
        assert module in mods, f"{name}: {module} is not a module of the project"
        assert _room(module) > _room("arpo_algo.cli"), f"{name}: {module} belongs among the built-in commands"
        assert "def register(" in mods[module].read_text(encoding="utf-8"), f"{module} has no register()"


def _test_files() -> list[Path]:
    return sorted((REPO / "tests").rglob("*.py"))


def test_only_a_scripts_own_tests_import_it():
    """The package never depends on benchmarks, studies or examples, and a test imports one only when it is that
    folder's own test (tests/benchmarks/ for benchmarks/, tests/studies/ for studies/); any test may run one as people
    do (``python -m benchmarks.x`` in a child process)."""
    bad = []
    for path in _test_files():
        rel = path.relative_to(REPO)
        module = ".".join(rel.with_suffix("").parts)
        for name, line in _imports(path, module, runs=False):
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
    # PEP 561: each top-level package carries an empty py.typed, so type checkers read the annotations of an install
    untyped = [
        top for top in ("arpo_base", "arpo_env", "arpo_algo", "serve") if not (REPO / top / "py.typed").is_file()
    ]
    assert not untyped and "py.typed" in patterns, f"no py.typed shipped in {untyped or 'the package data'}"
