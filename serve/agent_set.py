"""The agents of one replica as a set that changes while it serves (Serve's ``reconfigure``, :mod:`serve.live`).

Adapter agents share one copy of their base (:class:`serve.runtime.SharedBase`); every other agent has an engine of
its own. A new set is applied by loading the added agents first (a set that fails to load leaves the served one as
it was), then taking the removed ones out of routing (404 for new requests at once) and freeing each once its
running requests are done.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from arpo_algo.rollout.engines import engine_spec
from arpo_base.errors import ConfigError
from serve.agents import AgentSpec, check_agents, specs_from_args

log = logging.getLogger("arpo.serve")


def load_failure(e: BaseException) -> str:
    """What the operator reads when an agent does not load: a user's mistake (ArpoError) as its message and hint, any
    other error as its type and message; the traceback stays in the replica's log."""
    from arpo_base.errors import ArpoError

    if isinstance(e, ArpoError):
        return e.message + (f" (hint: {e.hint})" if e.hint else "")
    return f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (the replica log has the details)"


class LoadFailed(Exception):
    """An agent of a new set did not load: its name and the cause, as the operator reads them."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"loading the agent {name!r} failed: {load_failure(cause)}")
        self.name = name


@dataclass
class Staged:
    """A set loaded beside the served one (:meth:`AgentSet.prepare`): its specs, the agents loaded for it (not
    routed yet) and the names it takes out of routing."""

    specs: list[AgentSpec]
    loaded: dict[str, Any]
    gone: list[str]


def agents_from_config(config: dict[str, Any]) -> list[AgentSpec]:
    """The agents of a deployment's ``user_config``: ``{"agents": [spec dicts]}`` (what :func:`serve.app.build_app`
    and ``arpo serve`` write) or ``{"models": ...}`` plus the other keys of :func:`serve.agents.specs_from_args`."""
    if "agents" in config:
        extra = set(config) - {"agents"}
        if extra:
            raise ConfigError(f"user_config: unknown keys {sorted(extra)} beside 'agents'")
        specs = []
        for d in config["agents"]:
            try:
                specs.append(AgentSpec(**d))
            except TypeError as e:
                raise ConfigError(f"user_config: an agent entry is not an agent spec ({e})") from None
        return specs
    return specs_from_args(config)


class AgentSet:
    """``agents`` (name -> :class:`serve.runtime.Agent`, changed in place), their ``specs`` and the shared base.

    Args:
        specs: The agents to load first (:meth:`new_agent` loads each).
        drain_s: How long a removed agent's running requests may take (a request's deadline and its grace): after
            that its adapter or engine is freed even if a request never reported its end.
    """

    def __init__(self, specs: list[AgentSpec], drain_s: float) -> None:
        self.specs, self.drain_s = list(specs), drain_s
        self.agents: dict[str, Any] = {}
        self.shared: Any = None  # the base the adapter agents share (serve.runtime.SharedBase), once one is served

    def new_agent(self, spec: AgentSpec, specs: list[AgentSpec] | None = None) -> Any:
        """An adapter agent (or a full-weight one whose weights are the adapters' base) joins the shared base, made
        on first use and sized (on vLLM) for the adapter agents of ``specs`` (default: :attr:`specs`); any other
        agent gets an engine of its own."""
        from serve.runtime import Agent, SharedBase

        joins = spec.base or (self.shared is not None and spec.fingerprint == self.shared.fingerprint)
        if not joins or not engine_spec(spec.engine).capabilities.lora_ranks:  # no adapters: an engine of its own
            return Agent(spec)
        if self.shared is None:
            adapters = [s for s in (specs or self.specs) if s.base and s.fingerprint == spec.fingerprint]
            self.shared = SharedBase(spec.base, spec.fingerprint, spec.engine_settings, spec.engine, adapters)
        elif spec.base and spec.fingerprint != self.shared.fingerprint:
            raise ConfigError(
                f"agent {spec.name!r} is an adapter of the base {spec.fingerprint[:12]}..., but this "
                f"replica's adapters run on the base {self.shared.fingerprint[:12]}...",
                hint="serve adapters of another base in their own deployment",
            )
        return self.shared.add(spec)

    def prepare(self, specs: list[AgentSpec]) -> Staged:
        """Load the agents of ``specs`` that are new or changed beside the served ones, without routing to them:
        nothing served changes. A load that fails frees what this call loaded and raises :class:`LoadFailed`
        naming the agent."""
        check_agents(specs)
        old = {s.name: s for s in self.specs}
        staged = Staged(list(specs), {}, [n for n in old if n not in {s.name for s in specs} or old[n] not in specs])
        spec = None
        try:
            for spec in sorted((s for s in specs if s.name not in old or old[s.name] != s), key=lambda s: not s.base):
                staged.loaded[spec.name] = self.new_agent(spec, specs)
        except Exception as e:
            self.discard(staged)
            raise LoadFailed(getattr(spec, "name", "?"), e) from e
        return staged

    def commit(self, staged: Staged) -> None:
        """Serve a prepared set from now on: agents no longer listed out of routing at once (404 for new requests)
        and freed once their running requests are done; the loaded ones routed. Loads nothing, so it cannot fail
        half-way."""
        for name in staged.gone:
            agent = self.agents.pop(name, None)
            if agent is not None:
                threading.Thread(target=self.retire, args=(agent,), name="arpo-serve-retire", daemon=True).start()
        self.agents.update(staged.loaded)
        self.specs = staged.specs

    def discard(self, staged: Staged) -> None:
        """Free the agents a prepared set loaded (none was ever routed)."""
        for agent in staged.loaded.values():
            self.retire(agent)
        staged.loaded.clear()

    def apply(self, specs: list[AgentSpec]) -> None:
        """Serve ``specs`` from now on (:meth:`prepare`, then :meth:`commit`): a bad set changes nothing and raises."""
        self.commit(self.prepare(specs))

    def retire(self, agent: Any) -> None:
        """Free a removed agent once its running requests are done (at most ``drain_s`` later)."""
        deadline = time.monotonic() + self.drain_s
        while agent.running > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            if agent.adapter is not None:
                self.shared.remove(agent)
            elif self.shared is None or agent.front is not self.shared.front:
                agent.front.close()
        except Exception as e:  # noqa: BLE001 - freeing is best effort; the agent is unreachable already
            log.warning("freeing the removed agent %s failed", agent.spec.name, exc_info=e)
