"""arpo_base: the ground floor every room of arpo may use.

* :mod:`arpo_base.errors`: the user-facing errors (one line plus a hint, printed without a traceback);
* :mod:`arpo_base.options`: strict settings: unknown keys with "did you mean", type checks, choices, ``--set``
  overrides, and section dataclasses built and updated from dicts;
* :mod:`arpo_base.paths`: where arpo keeps models, data and caches;
* :mod:`arpo_base.http`: the one small HTTP JSON client;
* :mod:`arpo_base.ray_start`: how every arpo command starts Ray (its own, unless an address is given).

Pure Python: it imports neither torch, Ray, vLLM nor any other room of arpo (``ray_start`` imports Ray only when
called).
"""
