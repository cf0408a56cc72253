"""The commands other packages add to ``arpo``, found through the ``arpo.commands`` entry-point group.

The command line is a room below the server (``serve``), so it never imports it: a package that adds commands
declares each one in its distribution's metadata, ``<command> = "<module>"``, where the module has the same
``register(subparsers)`` function as the built-in commands in this package. arpo's own ``pyproject.toml`` declares
``serve`` and ``view`` (the modules in ``serve/cli/``).

Where the entries come from: the installed metadata of every distribution. In a source checkout (the package folder
sits beside arpo's ``pyproject.toml``), arpo's own entries are read from that file instead, as data, because the
installed metadata of an editable install is written when pip installs it and lags behind the file until the next
install. A command whose module is missing or fails to import still appears in ``arpo --help``; running it raises
:class:`ArpoError` naming the module and the reason.
"""

from __future__ import annotations

import argparse
import tomllib
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from arpo_base.errors import ArpoError

GROUP = "arpo.commands"
#: The distribution whose entries a source checkout's pyproject.toml replaces.
DISTRIBUTION = "arpo"
#: The checkout's pyproject.toml, when the packages run from a source tree (absent in a wheel install).
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _checkout_entries(pyproject: Path) -> list[EntryPoint] | None:
    """arpo's own entries as the checkout's pyproject.toml declares them; None outside a checkout of arpo."""
    if not pyproject.is_file():
        return None
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    if project.get("name") != DISTRIBUTION:
        return None
    declared = project.get("entry-points", {}).get(GROUP, {})
    return [EntryPoint(name, value, GROUP) for name, value in declared.items()]


def entries(pyproject: Path = PYPROJECT) -> list[EntryPoint]:
    """Every declared command, one per name (a checkout's own declaration wins over stale metadata), by name."""
    own = _checkout_entries(pyproject)
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        if own is not None and dist is not None and dist.name == DISTRIBUTION:
            continue  # the checkout's pyproject.toml is the current declaration of arpo's own commands
        found.setdefault(ep.name, ep)
    for ep in own or []:
        found[ep.name] = ep
    return [found[name] for name in sorted(found)]


def _unavailable(name: str, ep: EntryPoint, error: BaseException):
    """The handler of a command whose module did not load: the reason in one line, and what to do."""
    module = ep.value.partition(":")[0]
    reason = f"{type(error).__name__}: {error}"

    def handler(args: argparse.Namespace) -> int:
        raise ArpoError(
            f"the `arpo {name}` command cannot load its module {module} ({reason})",
            hint=f"install the package that provides {module} (for arpo's own commands: pip install -e . in the "
            "checkout, or reinstall arpo); --verbose shows the import's traceback",
        ) from error

    return handler


def register(sub: argparse._SubParsersAction, pyproject: Path = PYPROJECT) -> None:
    """Add every declared command to ``sub``; one that does not load is listed and explains itself when run."""
    for ep in entries(pyproject):
        if ep.name in sub.choices:
            continue  # a built-in command keeps its name
        try:
            target: Any = ep.load()
            if not callable(getattr(target, "register", None)):
                raise AttributeError(f"{ep.value} has no register(subparsers) function")
            target.register(sub)
        except Exception as error:  # a broken plugin must not take the other commands down with it
            if ep.name in sub.choices:
                raise  # it registered and then failed: a bug in that module, shown as such
            # no option prefix: whatever follows the command is taken as is, so running it reaches the explanation
            p = sub.add_parser(
                ep.name, help=f"(unavailable: cannot load {ep.value})", add_help=False, prefix_chars="\0"
            )
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(func=_unavailable(ep.name, ep, error))
