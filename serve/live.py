"""Changing the agents of a running ``arpo serve`` (``POST /v1/agents``, behind the API key).

The agents of a deployment live in its Serve ``user_config``: a new one reconfigures the running replicas in place
(:meth:`serve.app.AgentServer.reconfigure`), so every replica sees the same set. The process that owns the
deployment (``arpo serve``) is the one that may redeploy it; a replica that receives ``POST /v1/agents`` hands the
change to it through a small named Ray actor (:class:`Mailbox`) and waits for the answer. The owner resolves the new
sources with the command line's own settings (tools, limits, engine), exactly as at start-up, and deploys; a change
that fails (an unknown folder, an adapter of another base, a duplicate name) changes nothing and its error goes
back to the client as a 400.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from arpo_base.errors import ArpoError, ConfigError

#: The mailbox's actor name and namespace (one ``arpo serve`` per Ray cluster).
MAILBOX, NAMESPACE = "arpo_serve_agents", "arpo_serve"
#: How often the owner looks for changes, and how long a replica waits for the answer.
POLL_S, ANSWER_TIMEOUT_S = 0.2, 600.0


@ray.remote(num_cpus=0)
class Mailbox:
    """Changes asked for by replicas and their answers, kept until read."""

    def __init__(self) -> None:
        self.pending: dict[int, dict] = {}
        self.answers: dict[int, dict] = {}
        self.n = 0

    def submit(self, change: dict) -> int:
        self.n += 1
        self.pending[self.n] = change
        return self.n

    def take(self) -> list[tuple[int, dict]]:
        out, self.pending = list(self.pending.items()), {}
        return out

    def answer(self, i: int, result: dict) -> None:
        self.answers[i] = result

    def result(self, i: int) -> dict | None:
        return self.answers.pop(i, None)


def parse_change(body: Any) -> dict[str, list[str]]:
    """``{"add": ["NAME=SOURCE", ...], "remove": ["NAME", ...]}``, checked (unknown keys refused)."""
    if not isinstance(body, dict) or not body or set(body) - {"add", "remove"}:
        raise ConfigError('the body must be {"add": ["NAME=SOURCE", ...], "remove": ["NAME", ...]}')
    change = {}
    for key in ("add", "remove"):
        items = body.get(key, [])
        if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
            raise ConfigError(f"'{key}' must be a list of non-empty strings")
        change[key] = items
    return change


def ask_owner(change: dict[str, list[str]]) -> dict:
    """From a replica: hand ``change`` to the deployment's owner and return its answer."""
    try:
        box = ray.get_actor(MAILBOX, namespace=NAMESPACE)
    except ValueError:
        raise ConfigError(
            "this deployment was not started by arpo serve, so nothing here can redeploy it",
            hint="with serve deploy, list the agents in the deployment's user_config",
        ) from None
    i = ray.get(box.submit.remote(change))
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while time.monotonic() < deadline:
        answer = ray.get(box.result.remote(i))
        if answer is not None:
            return answer
        time.sleep(POLL_S)
    raise TimeoutError("the agents were not changed in time")


class Owner:
    """The ``arpo serve`` side: the current agents and how to resolve and deploy a new set.

    Args:
        specs: The agents served now.
        resolve: ``resolve(sources) -> specs`` with the command line's settings (``serve.agents.build_specs``).
        deploy: ``deploy(specs)`` redeploys the application with these agents in its ``user_config``.
    """

    def __init__(
        self, specs: list[Any], resolve: Callable[[list[str]], list[Any]], deploy: Callable[[list[Any]], None]
    ) -> None:
        self.specs, self.resolve, self.deploy = list(specs), resolve, deploy
        # On this process's own node, not soft: the mailbox lives exactly as long as its owner can read it, so a
        # lost worker node cannot take it (and with it this process and the whole deployment) down.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.box = Mailbox.options(name=MAILBOX, namespace=NAMESPACE, scheduling_strategy=here).remote()

    def poll(self) -> None:
        """Apply every waiting change, in order, and answer each."""
        for i, change in ray.get(self.box.take.remote()):
            try:
                self.apply(change)
                answer = {"models": [s.name for s in self.specs]}
            except ArpoError as e:
                answer = {"error": e.message, "hint": e.hint}
            except Exception as e:  # noqa: BLE001 - the client gets its type; the log has the rest
                answer = {"error": f"{type(e).__name__}: {e}", "hint": None}
            self.box.answer.remote(i, answer)

    def apply(self, change: dict[str, list[str]]) -> None:
        from serve.agents import check_agents

        names = {s.name for s in self.specs}
        unknown = [n for n in change.get("remove", []) if n not in names]
        if unknown:
            raise ConfigError(f"no agent named {unknown[0]!r} is served", hint=f"served: {', '.join(sorted(names))}")
        kept = [s for s in self.specs if s.name not in change.get("remove", [])]
        added = self.resolve(change["add"]) if change.get("add") else []
        specs = kept + added
        if not specs:
            raise ConfigError("the change would leave no agent served", hint="add one in the same change")
        check_agents(specs)
        self.deploy(specs)
        self.specs = specs
