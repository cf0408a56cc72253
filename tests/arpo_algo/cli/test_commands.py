"""Commands that other packages add to ``arpo`` through the ``arpo.commands`` entry points: the server's own, one from
an installed distribution, and ones whose module is missing or broken (listed, and explained in one line when run).

The extra distributions are real metadata folders (``*.dist-info``) on ``PYTHONPATH`` of an ``arpo`` child process,
which is how an installed package declares its commands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_algo.cli import commands
from arpo_algo.cli.main import build_parser

REPO = Path(__file__).resolve().parents[3]
BUILT_IN = ("doctor", "quickstart", "model", "env", "data", "sft", "train", "tune", "eval", "export", "sandbox")


@pytest.fixture
def extra(tmp_path: Path) -> Path:
    """A distribution declaring three commands: one that works, one whose package is absent, one failing on import."""
    info = tmp_path / "arpo_extra-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: arpo-extra\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[arpo.commands]\nhello = arpo_extra_hello\nabsent = arpo_extra_absent.cli\nbroken = arpo_extra_broken\n"
    )
    (tmp_path / "arpo_extra_hello.py").write_text(
        "def register(sub):\n"
        "    p = sub.add_parser('hello', help='greet from an extra package')\n"
        "    p.add_argument('name')\n"
        "    p.set_defaults(func=lambda args: print(f'hello {args.name}'))\n"
    )
    (tmp_path / "arpo_extra_broken.py").write_text("raise RuntimeError('this module is broken')\n")
    return tmp_path


def run_arpo(*args: str, path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (path, REPO) if p))
    cmd = [sys.executable, "-m", "arpo_algo.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_the_server_commands_come_through_the_entry_points():
    """``arpo serve`` and ``arpo view`` are declared, not imported: the command line lists them after its own."""
    names = [ep.name for ep in commands.entries()]
    assert {"serve", "view"} <= set(names)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(sub.choices)[: len(BUILT_IN)] == list(BUILT_IN)
    assert {"serve", "view"} <= set(sub.choices)
    assert sub.choices["serve"].prog == "arpo serve" and any(a.dest == "port" for a in sub.choices["serve"]._actions)


def test_a_checkout_reads_its_own_declaration(tmp_path):
    """A pyproject.toml of another project is not arpo's declaration; arpo's is read as data, in its order by name."""
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "other"\n[project.entry-points."arpo.commands"]\nzz = "x.y"\n')
    assert "zz" not in [ep.name for ep in commands.entries(other)]
    own = tmp_path / "own.toml"
    own.write_text(
        '[project]\nname = "arpo"\n[project.entry-points."arpo.commands"]\nzz = "x.y"\naa = "serve.cli.view"\n'
    )
    found = {ep.name: ep.value for ep in commands.entries(own)}
    assert found["zz"] == "x.y" and found["aa"] == "serve.cli.view"
    assert "serve" not in found  # the file is the whole current declaration of arpo's own commands


def test_help_lists_every_command_even_when_one_cannot_load(extra):
    p = run_arpo("--help", path=extra)
    assert p.returncode == 0, p.stderr
    for name in (*BUILT_IN, "serve", "view", "hello", "absent", "broken"):
        assert f"    {name}" in p.stdout, name
    assert "unavailable: cannot load arpo_extra_absent.cli" in p.stdout


def test_an_installed_package_adds_a_command(extra):
    p = run_arpo("hello", "newcomer", path=extra)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "hello newcomer\n"


@pytest.mark.parametrize(
    ("command", "module", "reason"),
    [
        ("absent", "arpo_extra_absent.cli", "ModuleNotFoundError: No module named 'arpo_extra_absent'"),
        ("broken", "arpo_extra_broken", "RuntimeError: this module is broken"),
    ],
)
def test_a_command_that_cannot_load_says_so_plainly(extra, command, module, reason):
    p = run_arpo(command, "--any", "args", path=extra)
    assert p.returncode == 2
    lines = p.stderr.splitlines()
    assert lines[0] == f"error: the `arpo {command}` command cannot load its module {module} ({reason})"
    assert lines[1].startswith(f"hint: install the package that provides {module}")
    assert len(lines) == 2 and "Traceback" not in p.stderr
    verbose = run_arpo("--verbose", command, path=extra)
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr and reason.split(":")[0] in verbose.stderr
