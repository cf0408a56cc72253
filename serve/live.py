"""Changing the agents of a running ``arpo serve`` (``POST /v1/agents``, administration key only: :mod:`serve.admin`).

The agents of a deployment live in its Serve ``user_config``: a new one reconfigures the running replicas in place
(:func:`serve.admin.reconfigure`), so every replica sees the same set. The process that owns the deployment (``arpo
serve``) is the one that may redeploy it; a replica that receives ``POST /v1/agents`` hands the change to it through a
small named Ray actor (:class:`Mailbox`), which takes one change at a time, and waits for the answer. The owner checks
the change against the operator's :class:`serve.admin.AdminPolicy`, resolves the new sources with the command line's
own settings (tools, limits, engine), exactly as at start-up, then has every replica load it beside the served
agents and commits it only when all of them did: a change that fails anywhere changes nothing, and its error (naming
the agent and the cause) goes back to the client as a 4xx.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from arpo_base.errors import ArpoError, ConfigError

#: The mailbox's actor name and namespace (one ``arpo serve`` per Ray cluster).
MAILBOX, NAMESPACE = "arpo_serve_agents", "arpo_serve"
#: How often the owner looks for changes, and replicas for answers and reports.
POLL_S = 0.2
log = logging.getLogger("arpo.serve")


@ray.remote(num_cpus=0)
class Mailbox:
    """Changes asked for by replicas, their answers (kept until read), the replicas' reports of staged changes, and
    the last change's outcome. At most one change is in flight: another is refused until the owner is done."""

    def __init__(self, timeout_s: float, models: list[str]) -> None:
        self.timeout_s, self.n, self.busy = timeout_s, 0, False
        self.pending: dict[int, dict] = {}
        self.answers: dict[int, dict] = {}
        self.reports: dict[int, dict[str, str | None]] = {}
        self.state: dict[str, Any] = {"models": models, "change": None}

    def ready(self) -> bool:
        return True

    def submit(self, change: dict) -> tuple[int, float] | None:
        if self.busy:
            return None
        self.busy, self.n = True, self.n + 1
        self.pending[self.n] = change
        self.state = {**self.state, "change": {"id": self.n, "state": "in progress"}}
        return self.n, self.timeout_s

    def take(self) -> list[tuple[int, dict]]:
        out, self.pending = list(self.pending.items()), {}
        return out

    def answer(self, i: int, result: dict) -> None:
        self.answers = {k: v for k, v in self.answers.items() if k > i - 8}  # unread answers of given-up waits go
        self.answers[i] = result

    def done(self, state: dict[str, Any]) -> None:
        self.state, self.busy = state, False
        self.reports.pop(state["change"]["id"], None)

    def result(self, i: int) -> dict | None:
        return self.answers.pop(i, None)

    def report(self, i: int, replica: str, error: str | None) -> None:
        self.reports.setdefault(i, {})[replica] = error

    def reports_of(self, i: int) -> dict[str, str | None]:
        return dict(self.reports.get(i, {}))

    def status(self) -> dict[str, Any]:
        return self.state


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


class Owner:
    """The ``arpo serve`` side: the current agents and how to check, resolve and deploy a new set.

    Args:
        specs: The agents served now.
        resolve: ``resolve(sources) -> specs`` with the command line's settings (``serve.agents.build_specs``).
        deploy: ``deploy(user_config)`` redeploys the application with this ``user_config`` (it returns once every
            replica is reconfigured).
        admin: What a change may do (:class:`serve.admin.AdminPolicy`).
        replicas: How many replicas serve now (each must report a staged change).

    Invariant: the mailbox exists, and answers, before the first deploy: a replica that reports healthy can hand a
    change over at once.
    """

    def __init__(
        self,
        specs: list[Any],
        resolve: Callable[[list[str]], list[Any]],
        deploy: Callable[[dict[str, Any]], None],
        admin: Any,
        replicas: Callable[[], int],
    ) -> None:
        self.specs, self.resolve, self.deploy, self.admin, self.replicas = list(specs), resolve, deploy, admin, replicas
        # On this process's own node, not soft: the mailbox lives exactly as long as its owner can read it, so a
        # lost worker node cannot take it (and with it this process and the whole deployment) down.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.box = Mailbox.options(name=MAILBOX, namespace=NAMESPACE, scheduling_strategy=here).remote(
            admin.timeout_s, [s.name for s in self.specs]
        )
        ray.get(self.box.ready.remote())

    @staticmethod
    def config(specs: list[Any], **extra: Any) -> dict[str, Any]:
        return {"agents": [s.to_dict() for s in specs], **extra}

    def poll(self) -> None:
        """Apply every waiting change, in order, and answer each: once every replica serves the outcome (a refused
        change after the roll-back), except a change past its deadline, answered at the deadline. Another change is
        taken only when this one is done."""
        for i, change in ray.get(self.box.take.remote()):
            state = "applied"
            try:
                self.apply(i, change)
                ray.get(self.box.answer.remote(i, {"models": [s.name for s in self.specs]}))
            except Exception as e:  # noqa: BLE001 - answered to the client; the log has the rest
                state = "not applied" if isinstance(e, ChangeTimeout) else "refused"
                if not isinstance(e, (ArpoError, ChangeTimeout)):
                    log.error("change %s failed", i, exc_info=e)
                if not getattr(e, "answered", False):
                    self.answer(i, e)
                said = str(e) if isinstance(e, ChangeTimeout) else f"{type(e).__name__}: {e}"
                error = {"error": e.message if isinstance(e, ArpoError) else said}
            outcome = {"id": i, "state": state, **(error if state != "applied" else {})}
            ray.get(self.box.done.remote({"models": [s.name for s in self.specs], "change": outcome}))

    def answer(self, i: int, e: BaseException) -> None:
        if isinstance(e, ChangeTimeout):
            answer = {"error": str(e), "status": 504, "code": "timeout"}
        elif isinstance(e, ArpoError):
            answer = {"error": e.message, "hint": e.hint}
        else:
            answer = {"error": f"{type(e).__name__}: {e}", "hint": None}
        ray.get(self.box.answer.remote(i, answer))
        e.answered = True  # type: ignore[attr-defined]

    def checked(self, change: dict[str, list[str]]) -> list[Any]:
        """The set after ``change``, refused before anything loads: names, caps, roots, budget, bases."""
        from serve.agents import check_agents

        names = {s.name for s in self.specs}
        unknown = [n for n in change.get("remove", []) if n not in names]
        if unknown:
            raise ConfigError(f"no agent named {unknown[0]!r} is served", hint=f"served: {', '.join(sorted(names))}")
        add = change.get("add", [])
        if len(add) > self.admin.max_per_change:
            raise ConfigError(f"a change adds at most {self.admin.max_per_change} agents, got {len(add)}")
        kept = [s for s in self.specs if s.name not in change.get("remove", [])]
        if len(kept) + len(add) > self.admin.max_agents:
            raise ConfigError(f"the server serves at most {self.admin.max_agents} agents", hint="remove some first")
        added = self.resolve([self.admin.source(a) for a in add]) if add else []
        specs = kept + added
        if not specs:
            raise ConfigError("the change would leave no agent served", hint="add one in the same change")
        check_agents(specs)
        self.admin.check_budget(specs)
        return specs

    def apply(self, i: int, change: dict[str, list[str]]) -> None:
        """Check, stage in every replica, then commit; a failure anywhere or the deadline drops the staged set in
        every replica (after the staging deploy ended: the roll-back is the last configuration)."""
        deadline = time.monotonic() + self.admin.timeout_s
        specs = self.checked(change)
        late = ChangeTimeout(f"the change was not loaded within {self.admin.timeout_s:g} s: nothing changed")
        if time.monotonic() > deadline:  # its checks took the time: nothing was staged
            raise ChangeTimeout(f"the change was not checked within {self.admin.timeout_s:g} s: nothing changed")
        old = self.config(self.specs)
        staged = {**old, "stage": {"id": i, **self.config(specs)}}
        staging = threading.Thread(target=self.deploy, args=(staged,), name="arpo-serve-stage", daemon=True)
        staging.start()
        errors = self.reports(i, staging, deadline)
        if errors is None or errors:
            failure: Exception = ConfigError(errors[0]) if errors else late
            if errors is None:
                self.answer(i, failure)  # the deadline holds: the client learns now, the roll-back follows
            staging.join()
            self.deploy(old)
            raise failure
        staging.join()
        self.deploy(self.config(specs, commit=i))
        self.specs = specs

    def reports(self, i: int, staging: threading.Thread, deadline: float) -> list[str] | None:
        """The replicas' errors once one failed or all loaded the staged set; None past the deadline."""
        while time.monotonic() < deadline:
            reports = ray.get(self.box.reports_of.remote(i))
            errors = [e for e in reports.values() if e]
            if errors or (not staging.is_alive() and len(reports) >= self.replicas()):
                return errors
            time.sleep(POLL_S)
        return None


class ChangeTimeout(Exception):
    """A change not loaded within its deadline (dropped everywhere)."""


def running_replicas(app: str = "arpo", deployment: str = "arpo_agents") -> int:
    """How many replicas of the deployment run now (from Serve's status)."""
    from ray import serve

    info = serve.status().applications[app].deployments[deployment]
    return sum(n for state, n in info.replica_states.items() if str(state).split(".")[-1] != "STOPPING")
