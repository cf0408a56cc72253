"""The Ray Serve application: an OpenAI-compatible agent endpoint (FastAPI ingress) plus a chat page at ``/``.

Routes: ``POST /v1/chat/completions`` (JSON or server-sent events), ``GET /v1/models`` and ``GET /v1/models/{id}``,
``GET /health`` (200 only once
every agent is loaded and its engine alive, 503 otherwise), ``GET /`` (the page), and ``POST``/``GET /v1/agents``
(live agent changes, with the administration key only: :mod:`serve.admin`). :mod:`serve.guard` checks every
request first (docs/security.md). All agents of one application live in every replica and
are routed by the request's ``model``. Overload: each replica runs at most ``max_ongoing_requests`` chat requests at
once and lets at most ``max_queued_requests`` more wait for a slot (:class:`Admission`); beyond that it answers an
OpenAI-shaped 503 with ``Retry-After``, counted like every answer. Serve's own limits sit above these
(:data:`SERVE_HEADROOM`), so its proxy's plain-text 503 is left for floods the replicas cannot even answer quickly.

Build it with :func:`build` (``serve run serve.app:build models=runs/sft,arpo=runs/arpo``), a Serve config file
(``examples/serve_config.yaml``, ``serve deploy``) or ``arpo serve``.
"""

# No `from __future__ import annotations` here: Serve's ingress rebuilds the route signatures, and FastAPI must see
# `request: Request` as the class itself, not as a string (else the request becomes a required query parameter: 422).
import asyncio
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import BackpressureConfig

from arpo_base.errors import ConfigError
from serve import admin
from serve.agent_set import AgentSet, load_failure
from serve.agents import AgentSpec, check_agents, specs_from_args
from serve.batching import EngineDead
from serve.guard import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    REQUEST_TIMEOUT_S,
    Guard,
    Policy,
    Security,
    count_fault,
    install,
    page_csp,
    refuse_route_prefix,
)
from serve.openai_api import function_call_item, function_output_item
from serve.record import RecordConfig, Recorder, check_record, post_reward, request_episode
from serve.schema import APIError, parse_chat_request

PAGE = Path(__file__).with_name("static") / "index.html"
#: Defaults of the deployment (``arpo serve`` and ``build`` arguments override them).
DEFAULTS = {
    "num_replicas": 1,
    "max_ongoing_requests": 16,
    "max_queued_requests": 32,
    "retry_after_s": 1.0,
    "num_cpus": 1.0,
}
#: The documented autoscaling config (used with ``autoscale=true`` / ``--autoscale``): one replica per 8 ongoing
#: requests, between 1 and 4 replicas, scale up after 5 s of load and down after 60 s idle.
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": 8,
    "upscale_delay_s": 5.0,
    "downscale_delay_s": 60.0,
    "metrics_interval_s": 2.0,
    "look_back_period_s": 10.0,
}
#: How long a request past its deadline waits for its cancelled run to stop (its tool process killed, its engine rows
#: dropped) before the 504 goes out anyway; normally a fraction of a second (the sandbox polls every 0.1 s).
CANCEL_GRACE_S = 5.0
#: Serve lets this many requests more than the admission's running + waiting reach a replica (health checks, /v1/models
#: and the refusals themselves), and queues as many at its proxy: the replica sheds load first, OpenAI-shaped.
SERVE_HEADROOM = 16
log = logging.getLogger("arpo.serve")

api = FastAPI(title="arpo serve", docs_url=None, redoc_url=None, openapi_url=None)
api.add_middleware(Guard)


def _error(e: APIError, retry_after_s: float = 1.0) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Admission:
    """A replica's chat requests: at most ``running`` at once, at most ``waiting`` more waiting for a slot in
    arrival order; one more is refused at once (:meth:`enter` raises a 503 :class:`APIError`). Event-loop only."""

    def __init__(self, running: int, waiting: int) -> None:
        self.slots, self.waiting_limit, self.waiting = asyncio.Semaphore(running), waiting, 0

    async def enter(self) -> None:
        if self.slots.locked() and self.waiting >= self.waiting_limit:
            raise APIError(
                "the server is overloaded (every slot is busy and the queue is full); retry shortly",
                status=503,
                type="server_error",
                code="server_overloaded",
            )
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        self.slots.release()


def _unavailable(what: str) -> APIError:
    return APIError(f"{what}; retry shortly", status=503, type="server_error", code="engine_unavailable")


def _internal(e: BaseException, where: str) -> APIError:
    """A server fault as an OpenAI-shaped 500: its type only (messages may name files); the log has the rest."""
    log.error("%s failed", where, exc_info=e)
    return APIError(
        f"internal error ({type(e).__name__}) in {where}; the server log has the details",
        status=500,
        type="server_error",
        code="internal_error",
    )


async def _stop(cancel: threading.Event, future: asyncio.Future) -> None:
    """Cancel a request's run and wait (at most CANCEL_GRACE_S) until it has stopped: its running tool call's
    process is killed and its engine rows dropped, so no work of an answered request goes on."""
    cancel.set()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is ours to drop, not to log
    await asyncio.wait({future}, timeout=CANCEL_GRACE_S)


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Backstop: a fault no route caught still answers OpenAI-shaped JSON, never Starlette's plain-text 500, and is
    counted (the route that failed counted nothing: a request is counted last, once all of it went well)."""
    err = _internal(exc, f"{request.method} {request.url.path}")
    count_fault(err.status)
    return _error(err)


@serve.deployment(name="arpo_agents")
@serve.ingress(api)
class AgentServer:
    """One replica: every agent's engine behind its batching front, and the HTTP routes."""

    def __init__(
        self,
        specs: list[dict[str, Any]],
        max_ongoing_requests: int = DEFAULTS["max_ongoing_requests"],
        security: dict[str, Any] | None = None,
        max_queued_requests: int = DEFAULTS["max_queued_requests"],
        retry_after_s: float = DEFAULTS["retry_after_s"],
        record: dict[str, Any] | None = None,
    ):
        from serve.metrics import ServeMetrics

        refuse_route_prefix()  # before anything is built: a replica under a prefix never serves
        self.security = Security(**(security or {}))
        self.set = AgentSet([AgentSpec(**s) for s in specs], self.security.request_timeout_s + CANCEL_GRACE_S)
        self.metrics = ServeMetrics()
        # Before anything is served: without a policy the guard refuses every request.
        self.policy = Policy(self.security, on_refusal=lambda status: self.metrics.request("-", str(status), 0.0))
        install(self.policy)
        self.page = PAGE.read_text(encoding="utf-8")
        self.page_csp = page_csp(self.page)
        self.agents = self.set.agents  # name -> serve.runtime.Agent (the set changes it in place)
        self.admission = Admission(max_ongoing_requests, max_queued_requests)
        self.retry_after_s = retry_after_s
        self.recorder = Recorder(RecordConfig(**record)) if record else None  # episodes (arpo serve --record)
        self.load_error: str | None = None
        self.loaded = threading.Event()
        # One thread per admitted request (its agent loop blocks on the batching front), plus some slack.
        self.pool = ThreadPoolExecutor(max_workers=max_ongoing_requests + 4, thread_name_prefix="arpo-serve-req")
        self.admin_pool, self.staged, self.refuse_next_change_with = admin.admin_pool(), None, None
        threading.Thread(target=self._load, name="arpo-serve-load", daemon=True).start()

    def _load(self) -> None:
        spec = None
        try:
            check_agents(self.set.specs)
            # adapters first: a full-weight agent that is their base then joins the shared copy
            for spec in sorted(self.set.specs, key=lambda s: not s.base):
                self.agents[spec.name] = self.set.new_agent(spec)
        except Exception as e:  # noqa: BLE001 - reported by /health and check_health
            log.error("loading agent %s failed", getattr(spec, "name", "?"), exc_info=e)
            self.load_error = f"loading the agent '{getattr(spec, 'name', '?')}' failed: {load_failure(e)}"
        finally:
            self.loaded.set()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's live update (``user_config`` changed, the replica stays), on the admin thread: a change is staged
        beside the served agents, then committed or dropped (:func:`serve.admin.reconfigure`)."""
        await asyncio.get_running_loop().run_in_executor(self.admin_pool, admin.reconfigure, self, user_config)

    def refuse_next_change(self, reason: str) -> None:
        """Make this replica refuse the next staged change (through a deployment handle only, never HTTP): the
        fault that shows a change one replica refuses leaves every replica on the served set."""
        self.refuse_next_change_with = reason

    def _dead(self) -> list[str]:
        return sorted(name for name, agent in self.agents.items() if not agent.front.alive())

    def check_health(self) -> None:
        """Serve's replica health check: a replica whose models failed to load or whose batching thread or engine
        is gone is replaced."""
        if self.load_error:
            raise RuntimeError(self.load_error)
        dead = self._dead()
        if dead:
            raise RuntimeError(f"the engine of {', '.join(dead)} is not running")

    def stop_engines(self) -> None:
        """Stop every agent's batching front and engine (requests in flight get 503); the replica then fails its
        health check and Serve replaces it."""
        fronts = {id(a.front): a.front for a in list(getattr(self, "agents", {}).values())}
        for front in fronts.values():  # a constructor that failed loaded nothing; a shared base closes once
            front.close()

    def replica_actor_id(self) -> str:
        """This replica's Ray actor id (for a deployment handle, not an HTTP route): a live update keeps it."""
        import ray

        return ray.get_runtime_context().get_actor_id()

    def __del__(self) -> None:
        self.stop_engines()

    def _agent(self, name: str) -> Any:
        if not self.loaded.is_set():
            raise APIError(
                "the agents are still loading; retry shortly", status=503, type="server_error", code="loading"
            )
        if name not in self.agents:
            known = ", ".join(sorted(self.agents)) or "none"
            raise APIError(
                f"The model '{name}' does not exist (served: {known})",
                param="model",
                status=404,
                code="model_not_found",
            )
        agent = self.agents[name]
        if not agent.front.alive():
            raise _unavailable(f"the engine of '{name}' is not running")
        return agent

    # ------------------------------------------------------------------------------------------------- routes
    @api.get("/health")
    def health(self, request: Request) -> JSONResponse:
        """200 when every agent is loaded and alive, else 503. Without the key it says only that."""
        full = self.policy.authorized(dict(request.headers))
        if self.load_error or self._dead():
            body = {"status": "error"}
            if full:
                body["error"] = self.load_error or f"the engine of {', '.join(self._dead())} is not running"
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        if not self.loaded.is_set():
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok", "models": sorted(self.agents)} if full else {"status": "ok"})

    def _card(self, s: AgentSpec) -> dict[str, Any]:
        # Names only: a model's folder is the operator's business, not the client's.
        # The base by its weights fingerprint: which agents share one (adapters of it, or the base itself).
        return {
            "id": s.name,
            "object": "model",
            "created": 0,
            "owned_by": "arpo",
            "arpo": {
                "engine": s.engine,
                "tools": sorted((s.session.get("tools") or {"python": {}}).keys()),
                "loaded": s.name in self.agents,
                "adapter": bool(s.base),
                "base": s.fingerprint or None,
            },
        }

    @api.get("/v1/models")
    def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._card(s) for s in self.set.specs]})

    @api.get("/v1/models/{model_id:path}")
    def model(self, model_id: str) -> JSONResponse:
        """One served agent, as in the list; 404 (OpenAI-shaped, naming the served ones) for any other name."""
        for s in self.set.specs:
            if s.name == model_id:
                return JSONResponse(self._card(s))
        known = ", ".join(sorted(s.name for s in self.set.specs)) or "none"
        err = APIError(
            f"The model '{model_id}' does not exist (served: {known})",
            param="model",
            status=404,
            code="model_not_found",
        )
        return _error(err)

    @api.post("/v1/agents")
    async def change_agents(self, request: Request) -> JSONResponse:
        """Add or remove agents of a running ``arpo serve``: ``{"add": ["NAME=SOURCE"], "remove": ["NAME"]}``, with
        the administration key only (:mod:`serve.admin`)."""
        return await admin.change(self, request)

    @api.get("/v1/agents")
    async def list_agents(self, request: Request) -> JSONResponse:
        """The served agents and the last change's outcome, with the administration key only."""
        return await admin.status(self, request)

    @api.get("/")
    def page(self) -> HTMLResponse:
        return HTMLResponse(self.page, headers={"Content-Security-Policy": self.page_csp})

    def _prepare(self, raw: bytes, headers: dict[str, str]) -> tuple[Any, Any, Any]:
        """Parse and tokenize (in a worker thread: a large body must not stall the event loop)."""
        req = parse_chat_request(raw)
        scope = request_episode(req, headers, self.recorder)
        agent = self._agent(req.model)
        return req, agent, agent.prepare(req, self.recorder, scope)

    @api.post("/v1/rewards")
    async def rewards(self, request: Request) -> JSONResponse:
        """Post an episode's reward (``{"episode", "reward", "turn_rewards"?}``), with the rewards key only."""
        t0 = time.perf_counter()
        status, out = await post_reward(self.recorder, request, self.pool)
        self.metrics.request("-", str(status), time.perf_counter() - t0)
        return JSONResponse(out, status_code=status)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        t0 = time.perf_counter()
        # The whole body first, under its own short deadline: a client that sends it slowly (or never) holds no slot.
        # A body past the limit raises out of here to the guard, which answers 413.
        try:
            raw = await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
        except TimeoutError:
            err = self.policy.too_slow()
            self.metrics.request("-", str(err.status), time.perf_counter() - t0)
            return JSONResponse(json.loads(err.body()), status_code=err.status, headers=err.headers)
        deadline = time.monotonic() + self.security.request_timeout_s  # the wait for a slot counts too
        try:
            await asyncio.wait_for(self.admission.enter(), self.security.request_timeout_s)
        except (TimeoutError, APIError) as e:
            err = self._run_error(e)
            self.metrics.request("-", str(err.status), time.perf_counter() - t0)
            return _error(err, self.retry_after_s)
        handed_over = False  # a stream leaves its slot when it ends; everything else when this returns
        try:
            response = await self._chat(raw, t0, deadline, dict(request.headers))
            handed_over = isinstance(response, StreamingResponse)
            return response
        finally:
            if not handed_over:
                self.admission.leave()

    async def _chat(self, raw: bytes, t0: float, deadline: float, headers: dict[str, str]) -> Any:
        loop = asyncio.get_running_loop()
        model = "-"
        try:
            req, agent, job = await loop.run_in_executor(self.pool, self._prepare, raw, headers)
            model = req.model
        except Exception as e:  # noqa: BLE001 - a client mistake (APIError) or a fault: both answered as JSON
            err = e if isinstance(e, APIError) else _internal(e, "preparing the request")
            self.metrics.request(model, str(err.status), time.perf_counter() - t0)
            return _error(err)
        cancel = threading.Event()
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": req.model}
        if req.stream:
            return StreamingResponse(
                self._stream(agent, job, cancel, meta, t0, deadline, self.admission.leave),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        future = loop.run_in_executor(self.pool, agent.run, job, cancel, None)
        try:
            result = await asyncio.wait_for(asyncio.shield(future), max(deadline - time.monotonic(), 0.0))
        except asyncio.CancelledError:  # the client went away: end the conversation at the next round
            cancel.set()
            self.metrics.request(model, "499", time.perf_counter() - t0)
            raise
        except Exception as e:  # noqa: BLE001 - every failure is answered OpenAI-style, never as plain text
            await _stop(cancel, future)  # past the deadline: its tool process is killed before the answer goes out
            err = self._run_error(e)
            self.metrics.request(model, str(err.status), time.perf_counter() - t0)
            return _error(err)
        self.metrics.finished(model, result, time.perf_counter() - t0)
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion",
                "system_fingerprint": None,
                "choices": result["choices"],
                "usage": result["usage"],
            }
        )

    def _run_error(self, e: BaseException) -> APIError:
        if isinstance(e, asyncio.TimeoutError):
            return APIError(
                f"the request took longer than the server's limit of {self.security.request_timeout_s:g} s"
                " (tool calls included); ask for fewer tokens or tool calls",
                status=504,
                type="server_error",
                code="timeout",
            )
        if isinstance(e, EngineDead):
            return _unavailable("the agent's engine stopped")
        if isinstance(e, APIError):
            return e
        return _internal(e, "the agent's run")

    async def _stream(
        self, agent: Any, job: Any, cancel: threading.Event, meta: dict, t0: float, deadline: float, leave: Any
    ):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, index: int, payload: Any) -> None:  # called from the agent and engine threads
            loop.call_soon_threadsafe(queue.put_nowait, (kind, index, payload))

        future = loop.run_in_executor(self.pool, agent.run, job, cancel, emit)
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, ("end", -1, None)))
        base = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None}

        def chunk(choices: list, **extra: Any) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        finished = False
        try:
            for i in range(job.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            while True:
                kind, i, payload = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.0))
                if kind == "end":
                    break
                if kind == "delta":
                    yield chunk([{"index": i, "delta": {"content": payload}, "finish_reason": None}])
                elif kind == "logprobs":
                    lp = {"content": payload, "refusal": None}
                    yield chunk([{"index": i, "delta": {}, "logprobs": lp, "finish_reason": None}])
                elif kind in ("tool_call", "tool_result"):
                    item = (function_call_item if kind == "tool_call" else function_output_item)(
                        payload, payload["call_id"]
                    )
                    delta = {"arpo": {"type": kind, **payload}}
                    yield chunk([{"index": i, "delta": delta, "output": [item], "finish_reason": None}])
                elif kind == "done":
                    delta: dict[str, Any] = {"arpo": {"type": "done", **payload["message"].get("arpo", {})}}
                    if payload["message"].get("tool_calls"):
                        delta["tool_calls"] = [
                            {"index": k, **c} for k, c in enumerate(payload["message"]["tool_calls"])
                        ]
                    yield chunk([{"index": i, "delta": delta, "finish_reason": payload["finish_reason"]}])
            result = future.result()
            if job.include_usage:
                yield chunk([], usage=result["usage"])
            yield "data: [DONE]\n\n"
            finished = True
            self.metrics.finished(meta["model"], result, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, OpenAI style
            finished = True
            await _stop(cancel, future)
            err = self._run_error(e)
            yield f"data: {json.dumps(err.body())}\n\n"
            self.metrics.request(meta["model"], str(err.status), time.perf_counter() - t0)
        finally:
            leave()  # the request's admission slot, held while it streams
            if not finished:  # client disconnect (generator cancelled or closed): free the engine rows
                cancel.set()
                self.metrics.request(meta["model"], "499", time.perf_counter() - t0)


def deployment_options(
    *,
    replicas: int | None = None,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int | None = None,
    retry_after_s: float | None = None,
    autoscale: bool = False,
    num_cpus: float | None = None,
    replica_resources: dict[str, float] | None = None,
    max_replicas_per_node: int | None = None,
) -> dict[str, Any]:
    """Serve deployment options (``.options(**...)``): Serve's own concurrency and queue bound, set
    :data:`SERVE_HEADROOM` above the replica's :class:`Admission` (``max_ongoing_requests`` running,
    ``max_queued_requests`` waiting), its 503 + Retry-After as the backstop, autoscaling; ``replica_resources``
    (Ray custom resources each replica asks for) and ``max_replicas_per_node`` place the replicas on a cluster."""
    running, waiting = admission_limits(max_ongoing_requests, max_queued_requests)
    opts: dict[str, Any] = {
        "max_ongoing_requests": running + waiting + SERVE_HEADROOM,
        "max_queued_requests": waiting + SERVE_HEADROOM,
        "backpressure_config": BackpressureConfig(
            status_code=503, retry_after_s=retry_after_s if retry_after_s is not None else DEFAULTS["retry_after_s"]
        ),
        "ray_actor_options": {"num_cpus": num_cpus if num_cpus is not None else DEFAULTS["num_cpus"]},
        "health_check_period_s": 10.0,
    }
    if replica_resources is not None:
        opts["ray_actor_options"]["resources"] = check_replica_resources(replica_resources)
    if max_replicas_per_node is not None:
        if max_replicas_per_node < 1:
            raise ConfigError(f"max_replicas_per_node must be >= 1, got {max_replicas_per_node}")
        opts["max_replicas_per_node"] = max_replicas_per_node
    if autoscale:
        opts["autoscaling_config"] = dict(AUTOSCALING, max_replicas=max(AUTOSCALING["max_replicas"], replicas or 1))
    else:
        opts["num_replicas"] = replicas or DEFAULTS["num_replicas"]
    return opts


def check_replica_resources(table: Any) -> dict[str, float]:
    """A replica's custom resources: a table of names to amounts > 0 (CPUs are ``num_cpus``, GPUs the engine's)."""
    if not isinstance(table, dict) or not table:
        raise ConfigError(
            f"replica resources must be a non-empty table of custom resources, got {table!r}",
            hint="--replica-resources '{\"worker\": 1}'",
        )
    for key, amount in table.items():
        if key.upper() in ("CPU", "GPU") or key in ("memory", "object_store_memory"):
            raise ConfigError(
                f"replica resources: {key!r} is not a custom resource", hint="CPUs per replica are set by num_cpus"
            )
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
            raise ConfigError(f"replica resources: {key} must be a number > 0, got {amount!r}")
    return {k: float(v) for k, v in table.items()}


def admission_limits(max_ongoing_requests: int | None, max_queued_requests: int | None) -> tuple[int, int]:
    """(running, waiting) of a replica's :class:`Admission`, the defaults filled in."""
    running = max_ongoing_requests or DEFAULTS["max_ongoing_requests"]
    waiting = max_queued_requests if max_queued_requests is not None else DEFAULTS["max_queued_requests"]
    if running < 1 or waiting < 0:
        raise ConfigError(
            f"max_ongoing_requests must be >= 1 and max_queued_requests >= 0, got {running} and {waiting}"
        )
    return running, waiting


def build_app(
    specs: list[AgentSpec],
    security: Security | None = None,
    user_config: dict[str, Any] | None = None,
    record: RecordConfig | None = None,
    **options: Any,
) -> Any:
    """The Serve application for these agents (``serve.run(build_app(...), route_prefix="/")``).

    ``security`` defaults to :class:`serve.guard.Security`'s defaults: loopback ``Host`` names on port 8000 and an
    API key required (from ``ARPO_API_KEY``); the key is checked here, so a missing one fails before Serve starts.
    """
    security = security or Security()
    security.key()
    check_record(security, record)
    check_agents(specs)
    opts = deployment_options(**options)
    running, waiting = admission_limits(options.get("max_ongoing_requests"), options.get("max_queued_requests"))
    retry = options.get("retry_after_s")
    args = (
        [s.to_dict() for s in specs],
        running,
        security.to_dict(),
        waiting,
        DEFAULTS["retry_after_s"] if retry is None else retry,
        None if record is None else asdict(record),
    )
    deployment = AgentServer.options(**opts)
    if user_config is not None:  # the agents served live (reconfigure); ``specs`` are loaded first
        deployment = AgentServer.options(**opts, user_config=user_config)
        # Serve gives every serve.run a new random code version, which replaces the replicas. This one names the
        # constructor arguments and options only, so deploying the same app with other agents in user_config keeps
        # the replicas and reconfigures them (what `serve deploy` does for a config file).
        text = json.dumps([args, {k: repr(v) for k, v in sorted(opts.items())}], sort_keys=True, default=repr)
        deployment._version = "arpo-" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return deployment.bind(*args)


def _flag(value: Any) -> bool:
    text = str(value).strip().lower()
    if text not in ("1", "true", "yes", "0", "false", "no", ""):
        raise ConfigError(f"expected true or false, got {value!r}")
    return text in ("1", "true", "yes")


def security_from_args(args: dict[str, Any]) -> Security:
    """The :class:`Security` of ``serve run`` / config-file arguments. The key itself is never one of them."""
    if "api_key" in args:
        raise ConfigError(
            "the API key must not be a deployment argument (Serve shows and stores those)",
            hint="set ARPO_API_KEY in the environment of the Ray cluster, or name a key_file",
        )
    hosts = args.get("allowed_hosts") or []
    if isinstance(hosts, str):
        hosts = [h.strip() for h in hosts.split(",") if h.strip()]
    sec = Security(
        key_file=args.get("key_file") or None,
        allow_unauthenticated=_flag(args.get("allow_unauthenticated", False)),
        allowed_hosts=list(hosts),
        port=int(args.get("port", 8000)),
        tls=_flag(args.get("tls", False)),
        max_body_bytes=int(args.get("max_body_bytes", MAX_BODY_BYTES)),
        request_timeout_s=float(args.get("request_timeout_s", REQUEST_TIMEOUT_S)),
    )
    sec.key()  # fails here, naming the fix, rather than in every replica
    return sec


def build(args: dict[str, Any]) -> Any:
    """Application builder for Ray's CLI: ``serve run serve.app:build models=A,B tools=python replicas=2``.

    Keys: those of :func:`serve.agents.specs_from_args` plus ``replicas``, ``max_ongoing_requests``,
    ``max_queued_requests``, ``retry_after_s``, ``autoscale`` (true/false), ``num_cpus``, and the security keys
    ``key_file``, ``allow_unauthenticated``, ``allowed_hosts``, ``port``, ``tls``, ``max_body_bytes``,
    ``request_timeout_s`` (docs/security.md).
    """

    def num(key: str, cast: Any) -> Any:
        return cast(args[key]) if args.get(key) not in (None, "") else None

    security_keys = {
        "key_file",
        "allow_unauthenticated",
        "allowed_hosts",
        "port",
        "tls",
        "max_body_bytes",
        "request_timeout_s",
        "api_key",
    }
    security = security_from_args(args)
    rest = {k: v for k, v in args.items() if k not in security_keys}
    return build_app(
        specs_from_args(rest),
        security,
        replicas=num("replicas", int),
        max_ongoing_requests=num("max_ongoing_requests", int),
        max_queued_requests=num("max_queued_requests", int),
        retry_after_s=num("retry_after_s", float),
        autoscale=_flag(args.get("autoscale", False)),
        num_cpus=num("num_cpus", float),
    )
