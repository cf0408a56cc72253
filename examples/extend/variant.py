"""Add an algorithm variant: ARPO as its released code runs it.

A variant is one module: a config class that states its preset (its defaults, by dotted setting name) and what it
changes from ARPO (the same names, each with the mechanism or paper section it comes from), an Algorithm class, and
ONE registration line. ``[experiment] algorithm = "arpo_code"`` (once this module is imported), Tune and the settings
checks then know it; ``ArpoCodeConfig()`` builds it in Python. A variant may also bring a branch policy of its own:
``preset = {"tree.branch_policy": "random"}`` (a built-in; ``examples/extend/branch_policy.py`` adds one).

Run the demo: ``python examples/extend/variant.py`` (prints the variant's settings that differ from ARPO's).
"""

from __future__ import annotations

from arpo_algo.algorithms import ARPO, ARPOConfig, register_variant


class ArpoCodeConfig(ARPOConfig):
    """ARPO with the released code's choices where it departs from the paper (docs/concepts/reference-choices.md)."""

    variant = "arpo_code"
    tree_mode = "arpo"  # the tree sampler family (inherited; stated for the reader)
    preset = {"tree.decision_rule": "reference", "tree.fillup": "trickle"}
    changes = {
        "tree.decision_rule": "branch right after the tool result with probability alpha + beta * dH "
        "(the code's rule, docs/concepts/arpo.md#the-reference-rule; the paper's look-ahead rule is ARPO's default)",
        "tree.fillup": "one fresh sample per round once every path ended (the code, docs/concepts/arpo.md#fill-up)",
    }


class ArpoCode(ARPO):
    """ARPO as its released code runs it (:class:`ArpoCodeConfig`)."""


register_variant(ArpoCodeConfig, ArpoCode)


if __name__ == "__main__":
    base = ARPOConfig().settings.flat()
    for name, value in ArpoCodeConfig().settings.flat().items():
        if value != base[name]:
            print(f"{name} = {value!r}  # {ArpoCodeConfig.changes[name]}")
