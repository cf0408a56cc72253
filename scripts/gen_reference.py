"""Write the generated reference pages: the command line (from ``arpo_algo.cli.main.build_parser()``) and every
setting (from ``arpo_algo.algorithms.settings.setting_rows()``).

    python scripts/gen_reference.py            # rewrite docs/reference/cli.md and docs/reference/settings.md
    python scripts/gen_reference.py --check    # exit 1, naming the stale pages, when they differ from the code

The pages are committed so the documentation site builds without importing the package; ``tests/test_docs.py`` runs
``--check`` so they cannot drift from the parsers and the settings registry.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import pathlib
import re
import sys
import types
import typing
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
SETTINGS_PAGE = ROOT / "docs" / "reference" / "settings.md"
COMMAND = "python scripts/gen_reference.py"
#: Help text is wrapped by argparse at the terminal width: fixed here so the page does not depend on the terminal.
WIDTH = "100"
_PROBE = "\x00probe"
_INT_PROBE = -987654321


def _cell(text: Any) -> str:
    """One table cell: docstring markup (Sphinx roles, double backticks) as Markdown code, pipes escaped."""
    text = re.sub(r":(?:mod|class|func|data|attr|meth):`~?([^`]+)`", r"`\1`", str(text))
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


# ------------------------------------------------------------------------------------------------ command line


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str | None]]:
    """``{name: (parser, its one-line help)}`` of the parser's subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            return {name: (sub, helps.get(name)) for name, sub in action.choices.items()}
    return {}


def _parser_section(name: str, parser: argparse.ArgumentParser, level: int, summary: str | None = None) -> list[str]:
    lines = [f"{'#' * level} {name}", ""]
    texts = [summary, parser.description if parser.description != summary else None]
    lines += [x for text in texts if text for x in (inspect.cleandoc(text), "")]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        flags = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
        default = action.default
        shown = "" if default in (None, argparse.SUPPRESS, False) or action.option_strings == [] else f"`{default}`"
        helptext = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {flags} | {_cell(shown)} | {_cell(helptext)} |")
    if rows:
        lines += ["| argument | default | what it does |", "|---|---|---|", *rows, ""]
    for sub_name, (sub, summary) in _subparsers(parser).items():
        lines += _parser_section(f"{name} {sub_name}", sub, min(level + 1, 4), summary)
    return lines


def cli_page() -> str:
    os.environ["COLUMNS"] = WIDTH
    from arpo_algo.cli.main import build_parser

    parser = build_parser()
    lines = [
        "# Command line",
        "",
        f"Generated from the argument parsers by `{COMMAND}`; do not edit by hand.",
        "",
        "Every command prints errors caused by its input as one line plus a hint and exits with code 2; "
        "`--verbose` (before the command) adds the traceback.",
        "",
    ]
    lines += _parser_section("arpo", parser, 2)
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------- settings


def _settings_module() -> types.ModuleType:
    """``arpo_algo.algorithms.settings``, imported with its package: the variants' presets (their own defaults on the
    settings page) are registered by the package's variant modules."""
    import arpo_algo.algorithms  # noqa: F401  (registers the variants)
    import arpo_algo.algorithms.settings as settings

    return settings


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``Attributes:`` section of ``cls``'s docstring and those of its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.cleandoc(klass.__dict__.get("__doc__") or "")
        lines = doc.splitlines()
        if "Attributes:" not in lines:
            continue
        name = None
        for line in lines[lines.index("Attributes:") + 1 :]:
            if line and not line.startswith(" "):
                break
            stripped = line.strip()
            if line.startswith("        ") and name:
                docs[name] += " " + stripped
            elif line.startswith("    ") and ":" in stripped:
                name, text = stripped.split(":", 1)
                docs[name] = text.strip()
    return docs


def setting_doc(field: dataclasses.Field, owner: type) -> str | None:
    """The setting's sentence: ``setting(default, doc)`` metadata first, else the owner's ``Attributes:`` entry."""
    return field.metadata.get("doc") or attribute_docs(owner).get(field.name)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "str"
    if isinstance(tp, type):
        return tp.__name__
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(tp)) == 2:
        return f"{_type_name(args[0])} or None"
    return str(tp).replace("typing.", "")


def allowed_values(tp: Any, owner_default: Any, name: str) -> tuple[Any, ...] | None:
    """The values a setting accepts: a ``Literal`` type's, or the ones its section's ``validate()`` names when it
    refuses a probe value (fixed choices and registries alike report them)."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if tp not in (str, int):
        return None
    from arpo_base.errors import ConfigError

    try:
        dataclasses.replace(owner_default, **{name: _PROBE if tp is str else _INT_PROBE}).validate()
    except ConfigError as e:
        text = f"{e.message} {e.hint or ''}"
        if "is not one of " in text:
            listed = text.split("is not one of ", 1)[1].split(" did you mean")[0].strip()
            return tuple(v.strip().strip("'\"") for v in listed.split(","))
        if "registered: " in text:
            return tuple(v.strip() for v in text.split("registered: ", 1)[1].split(","))
    return None


def _owner(settings_obj: Any, dotted: str) -> Any:
    obj = settings_obj
    for part in dotted.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


def settings_rows() -> list[dict[str, Any]]:
    """One dict per setting: name, type, default, the algorithms' own defaults where they differ, allowed values,
    sentence (None when it has none)."""
    mod = _settings_module()
    defaults = mod.Settings()
    rows = []
    for dotted, tp, default, field in mod.setting_rows():
        owner = _owner(defaults, dotted)
        variants = {
            algo.upper(): table[dotted]
            for algo, table in mod.VARIANT_DEFAULTS.items()
            if dotted in table and table[dotted] != default
        }
        rows.append(
            {
                "name": dotted,
                "type": _type_name(tp),
                "default": default,
                "variants": variants,
                "allowed": allowed_values(tp, owner, field.name),
                "doc": setting_doc(field, type(owner)),
            }
        )
    return rows


def settings_page() -> str:
    rows = settings_rows()
    missing = [r["name"] for r in rows if not r["doc"]]
    if missing:
        raise SystemExit(
            f"settings without a sentence: {', '.join(missing)} (give each a setting(default, doc) "
            "or an Attributes: entry in its section's docstring)"
        )
    lines = [
        "# Settings",
        "",
        f"Generated from the settings registry by `{COMMAND}`; do not edit by hand.",
        "",
        "Each setting has one dotted name `section.key`: the key of an experiment file's `[section]` table, "
        "the `--set section.key=value` override, the sweep knob, the key of a Tune or RLlib config dict, "
        '`config.update_settings({"section.key": value})` and the attribute path `config.settings.section.key`. '
        "An unknown name fails with the closest valid one. A default in brackets is that algorithm's own "
        "(GRPO turns the tree sampler off; AEPO follows the released AEPO scripts).",
        "",
    ]
    section = None
    for r in rows:
        sec = r["name"].rsplit(".", 1)[0]
        if sec != section:
            section = sec
            lines += [
                "",
                f"## [{sec}]",
                "",
                "| setting | type | default | allowed | what it does |",
                "|---|---|---|---|---|",
            ]
        allowed = ", ".join(f"`{v}`" for v in r["allowed"]) if r["allowed"] else ""
        default = f"`{r['default']!r}`" + "".join(f" ({algo}: `{v!r}`)" for algo, v in r["variants"].items())
        lines.append(f"| `{r['name']}` | {r['type']} | {default} | {allowed} | {_cell(r['doc'])} |")
    return "\n".join(lines).strip() + "\n"


def pages() -> dict[pathlib.Path, str]:
    return {CLI_PAGE: cli_page(), SETTINGS_PAGE: settings_page()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) the generated reference pages.")
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed page differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"stale generated pages: {', '.join(stale)}; regenerate with: {COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
