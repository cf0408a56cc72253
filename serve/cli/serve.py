"""``arpo serve``: host trained agents behind an OpenAI-compatible API on Ray Serve (the app is :mod:`serve.app`)."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from arpo_algo.rollout.engines import engine_names
from arpo_base.errors import ArpoError, ConfigError

#: Ray Serve's own request timeout is this much longer than the app's deadline, so the app's OpenAI-shaped 504
#: answers first and Serve's plain one is only a backstop.
SERVE_TIMEOUT_SLACK_S = 5.0


def wait_ready(url: str, timeout_s: float, key: str | None = None, verify: bool = True) -> dict:
    """Poll ``GET url/health`` until it answers 200 (models loaded); raise naming the last answer otherwise."""
    from arpo_base.http import HTTPJSONError, bearer, request

    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            return request("GET", f"{url}/health", headers=bearer(key), timeout=5, verify=verify).data
        except HTTPJSONError as e:
            last = e.body or e.reason
            error = e.data.get("error") if isinstance(e.data, dict) else None
            if e.status is not None and error:
                raise ArpoError(
                    f"the agents failed to load: {error}", hint="fix what it names and start arpo serve again"
                ) from None
        time.sleep(0.5)
    raise ArpoError(f"the server did not become ready within {timeout_s:.0f} s ({last})")


def _key(args: argparse.Namespace) -> str | None:
    from serve.guard import KEY_ENV, read_key

    if args.api_key is not None and args.api_key_file is not None:
        raise ArpoError("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ArpoError("--api-key is empty", hint=f"give a key, or set {KEY_ENV}")
        return args.api_key.strip()
    return read_key(args.api_key_file)


def _own_key(args: argparse.Namespace, name: str, env: str) -> str | None:
    """A key of its own (``--NAME-key``, ``--NAME-key-file`` or the variable ``env``), or None when none is given."""
    from serve.guard import read_key

    given = getattr(args, f"{name}_key", None)
    if given is not None and getattr(args, f"{name}_key_file", None) is not None:
        raise ArpoError(f"give --{name}-key or --{name}-key-file, not both")
    if given is None:
        return read_key(getattr(args, f"{name}_key_file", None), env=env)
    if not given.strip():
        raise ArpoError(f"--{name}-key is empty", hint=f"give a key, or set {env}")
    return given.strip()


def admin_of(args: argparse.Namespace, key: str | None) -> tuple[Any, str | None]:
    """The live-change policy (:class:`serve.admin.AdminPolicy`) and the administration key, or (None, None): live
    changes are off without an admin key. Refused: an admin key equal to the chat key, a key without a root, a root
    without a key. Runs before anything starts."""
    import os

    from serve.admin import AdminPolicy
    from serve.guard import ADMIN_KEY_ENV

    admin = _own_key(args, "admin", ADMIN_KEY_ENV)
    roots = list(getattr(args, "admin_root", None) or [])
    if admin is None:
        if roots:
            raise ArpoError("--admin-root needs an admin key", hint=f"set {ADMIN_KEY_ENV} or pass --admin-key-file")
        return None, None
    if key is not None and admin == key:
        raise ArpoError(
            "the admin key is the API key: administration needs a credential of its own",
            hint=f"`export {ADMIN_KEY_ENV}=$(openssl rand -hex 32)`",
        )
    budget = getattr(args, "admin_memory_budget", None)
    policy = AdminPolicy(
        roots=[os.path.expanduser(r) for r in roots],
        max_per_change=args.admin_max_per_change,
        max_agents=args.admin_max_agents,
        memory_budget_bytes=int(budget * 1024**3) if budget is not None else None,
        timeout_s=args.admin_timeout,
    )
    return policy, admin


def record_of(args: argparse.Namespace, key: str | None, admin_key: str | None) -> tuple[Any, str | None]:
    """The recording settings (:class:`serve.record.RecordConfig`, None: recording off) and the rewards key (None:
    rewards by API off). Refused before anything starts: a rewards key without a record folder, one equal to the chat
    or admin key, a record folder other users may write."""
    from serve.guard import REWARDS_KEY_ENV
    from serve.record import RecordConfig, private_folder

    rewards = _own_key(args, "rewards", REWARDS_KEY_ENV)
    folder = getattr(args, "record", None)
    if folder is None:
        if rewards is not None:
            raise ArpoError(
                "a rewards key needs a record folder: there are no episodes to reward",
                hint=f"add --record DIR, or unset {REWARDS_KEY_ENV}",
            )
        return None, None
    for other, name in ((key, "API key"), (admin_key, "admin key")):
        if rewards is not None and rewards == other:
            raise ArpoError(
                f"the rewards key is the {name}: rewards need a credential of their own",
                hint=f"`export {REWARDS_KEY_ENV}=$(openssl rand -hex 32)`",
            )
    config = RecordConfig(
        dir=str(Path(folder).resolve()),
        max_bytes=int(args.record_max_gib * 1024**3),
        reward_deadline_s=args.reward_deadline,
    )
    config.check()
    private_folder(config.dir)
    return config, rewards


def security_of(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The deployment's :class:`serve.guard.Security` and the key; refuses an exposed server that is not guarded.
    Runs before anything starts (no model is loaded, Ray is not started)."""
    from serve.guard import Security, is_loopback

    key = _key(args)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ArpoError("TLS needs both --tls-cert and --tls-key")
    for path in (args.tls_cert, args.tls_key):
        if path and not Path(path).is_file():
            raise ArpoError(f"TLS file not found: {Path(path).name}", hint="give the PEM files of the certificate")
    if not is_loopback(args.host):
        if key is None:
            raise ArpoError(
                f"refusing to listen on {args.host} without an API key: anyone who reaches this port "
                "could run Python on this machine",
                hint="set ARPO_API_KEY (e.g. `export ARPO_API_KEY=$(openssl rand -hex 32)`), or pass "
                "--api-key-file FILE; or listen on 127.0.0.1",
            )
        if not args.allowed_hosts:
            raise ArpoError(
                f"listening on {args.host} needs --allowed-hosts: the host names clients use to reach "
                "this server (the Host header of any other name is refused)",
                hint="e.g. --allowed-hosts gpu1.example.org,10.0.0.5",
            )
    if args.request_timeout <= 0:
        raise ArpoError(f"--request-timeout must be > 0 seconds, got {args.request_timeout:g}")
    hosts = [h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()]
    return Security(
        allow_unauthenticated=key is None,
        allowed_hosts=hosts,
        port=args.port,
        tls=bool(args.tls_cert),
        request_timeout_s=args.request_timeout,
    ), key


def start(args: argparse.Namespace) -> str:
    """Start Ray (if needed), Serve on ``host:port`` and the application; return the base URL once ready."""
    import ray
    from ray import serve

    from arpo_base.ray_start import init_ray
    from serve.agents import build_specs
    from serve.app import build_app
    from serve.guard import is_loopback
    from serve.proxy import controller_options

    security, key = security_of(args)
    if isinstance(args.replica_resources, str):  # refused before Ray starts
        args.replica_resources = parse_replica_resources(args.replica_resources)

    def resolve(sources: list[str]) -> list[Any]:  # the same settings for agents added later (POST /v1/agents)
        return build_specs(
            sources,
            tools=args.tools,
            max_tool_calls=args.max_tool_calls,
            engine=args.engine,
            system_prompt=args.system_prompt,
            protocol=args.protocol,
            max_tokens=args.max_tokens,
            allow_unisolated_python=args.allow_unisolated_python,
            max_tokens_limit=args.max_tokens_limit,
        )

    admin, admin_key = admin_of(args, key)
    record, rewards_key = record_of(args, key, admin_key)
    specs = resolve(args.models)
    # the replicas (and the proxy's gate) read the keys from private files: a key is never a deployment argument
    keys = ((key, "key_file", "api_key"), (admin_key, "admin_key_file", "admin_key"))
    for secret, attr, name in (*keys, (rewards_key, "rewards_key_file", "rewards_key")):
        if secret is not None:
            args.key_dir = getattr(args, "key_dir", None) or tempfile.mkdtemp(prefix="arpo-serve-")
            key_path = Path(args.key_dir) / name
            key_path.touch(mode=0o600)
            key_path.write_text(secret, encoding="utf-8")
            setattr(security, attr, str(key_path))
    if not ray.is_initialized():
        init_ray(include_dashboard=False, log_to_driver=False, **local_ray_options(args.host))
        private_token_file()
    refuse_foreign_serve()
    if args.replica_resources is not None:
        check_replicas_fit(args)
    http = {"host": args.host, "port": args.port, "request_timeout_s": args.request_timeout + SERVE_TIMEOUT_SLACK_S}
    if args.tls_cert:
        http.update(ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key)
    # one proxy, on the head (where this command runs): clients have one address, and the worker nodes need no port;
    # a request whose replica is lost gets a 503 + Retry-After from it, not its plain-text 500, and its gate checks
    # Host, key and body before Serve queues anything (serve.proxy)
    serve.start(http_options=http, proxy_location="HeadOnly", controller_options=controller_options(security))

    def deploy(config: dict[str, Any]) -> None:  # the agents travel in user_config: a change reconfigures replicas
        app = build_app(
            specs,
            security,
            user_config=config,
            record=record,
            replicas=args.replicas,
            max_ongoing_requests=args.max_ongoing_requests,
            max_queued_requests=args.max_queued_requests,
            autoscale=args.autoscale,
            replica_resources=args.replica_resources,
            max_replicas_per_node=args.max_replicas_per_node,
        )
        serve.run(app, name="arpo", route_prefix="/", blocking=False)

    from serve.live import Owner, running_replicas

    # the owner's mailbox before the first replica: a server that reports healthy takes a change at once
    args.owner = Owner(specs, resolve, deploy, admin, running_replicas) if admin is not None else None
    deploy(Owner.config(specs))
    scheme = "https" if args.tls_cert else "http"
    local = args.host if is_loopback(args.host) else "127.0.0.1"
    # our own server, polled locally: its certificate need not name 127.0.0.1
    wait_ready(f"{scheme}://{local}:{args.port}", args.ready_timeout, key, verify=not args.tls_cert)
    url = f"{scheme}://{args.host}:{args.port}"
    print(f"serving {', '.join(s.name for s in specs)} at {url}  (chat page: {url}/ , API: {url}/v1/chat/completions)")
    print(
        "authentication: "
        + ("API key required on every route but / and /health" if key else "OFF (no API key; this machine only)")
    )
    print(
        f"live agent changes: on (admin key; sources under {', '.join(admin.roots)})"
        if admin
        else "live agent changes: off (no --admin-key)"
    )
    if record is not None:
        rewards = "rewards by API: on (rewards key)" if rewards_key else "rewards by API: off (no --rewards-key)"
        print(f"recording episodes: on (into {record.dir}); {rewards}")
    if args.tls_cert:
        print("TLS: on")
    elif is_loopback(args.host):
        print("TLS: off (this machine only)")
    else:
        print(
            "TLS: OFF - requests, answers and the API key cross the network in clear text; give --tls-cert and "
            "--tls-key"
        )
    return url


#: Ray reads this at import and on each node start: false keeps a one-node Ray on the loopback address it is given.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_ray_options(host: str) -> dict[str, Any]:
    """``ray.init`` options for the Ray that ``arpo serve`` starts itself: serving on loopback with no cluster to join
    (no ``RAY_ADDRESS``), Ray's own listeners (GCS, raylet, workers, metrics) bind loopback too, so nothing of the
    server, not even Ray's unauthenticated metrics, answers on another interface. Joining a cluster: {} (its nodes
    need their addresses)."""
    import os

    from serve.guard import is_loopback

    if not is_loopback(host) or os.environ.get("RAY_ADDRESS"):
        return {}
    import ray._private.ray_constants as ray_constants

    os.environ[RAY_LOOPBACK_ENV] = "0"  # for Ray's own processes, started from this one
    ray_constants.ENABLE_RAY_CLUSTER = False  # for this process: Ray read the variable when it was imported
    return {"_node_ip_address": "127.0.0.1"}


def refuse_foreign_serve() -> None:
    """Refuse to go on when the Ray this command uses already runs a Serve instance: ``arpo serve`` deploys only onto
    a Serve it starts, whose proxy, gate and timeouts it sets (a Serve started by others would keep theirs)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return
    raise ArpoError(
        "the Ray cluster this command joined already runs a Ray Serve instance that arpo serve did not start",
        hint="shut that Serve down (`serve shutdown`), or leave RAY_ADDRESS unset: arpo serve then starts its own Ray",
    )


def private_token_file() -> None:
    """Make Ray's authentication token file readable by its owner only (Ray writes it 0644)."""
    import os

    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not path.is_file() or path.stat().st_uid != os.getuid():
        return  # no token, or another user's file (not the one this Ray uses)
    try:
        path.chmod(0o600)
    except OSError as e:
        raise ArpoError(
            f"cannot make Ray's token file readable by its owner only: {e.strerror}", hint=f"chmod 600 {path}"
        ) from None


def parse_replica_resources(text: str) -> dict[str, float]:
    """``--replica-resources``: a JSON object of Ray custom resources per replica."""
    from serve.app import check_replica_resources

    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--replica-resources must be a JSON object, got {text!r}: {e.msg}",
            hint="--replica-resources '{\"worker\": 1}'",
        ) from e
    return check_replica_resources(table)


def check_replicas_fit(args: argparse.Namespace) -> None:
    """Refuse, before Serve starts, replicas the cluster cannot place: a replica waiting for a resource no node
    offers would leave the server never ready."""
    from arpo_algo.algorithms.components import SETTINGS_NAMES, check_custom_feasible
    from arpo_algo.train.backend_config import cluster_resources

    have, where = cluster_resources()
    count = args.replicas if not args.autoscale else 1
    try:
        check_custom_feasible([args.replica_resources] * count, have, where)
    except ArpoError as e:
        raise type(e)(
            e.message.replace(SETTINGS_NAMES, f"--replica-resources x {count} replica(s)"), hint=e.hint
        ) from e


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    """Handler of ``arpo serve``: runs until Ctrl-C or SIGTERM (``kill``, ``docker stop``), then shuts Serve down
    and Ray with it, so the replicas stop their engines (a vLLM engine runs in processes of its own)."""
    import ray
    from ray import serve

    def on_signals() -> None:  # SIGINT too: a shell starts background jobs with SIGINT ignored
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupt)

    _, key = security_of(args)  # an unguarded exposed server is refused before Ray starts (shutdown would start it)
    _, admin_key = admin_of(args, key)
    record_of(args, key, admin_key)
    if isinstance(args.replica_resources, str):
        args.replica_resources = parse_replica_resources(args.replica_resources)
    on_signals()
    try:
        start(args)
        on_signals()  # again: ray.init installs its own SIGTERM handler, which exits without shutting Serve down
        from serve.live import POLL_S

        while True:  # agents added or removed through POST /v1/agents are deployed from here
            if args.owner is not None:
                args.owner.poll()
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        print("shutting down")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        if ray.is_initialized():  # a refusal before Ray started must not start it (serve.shutdown would)
            serve.shutdown()
            ray.shutdown()
        if getattr(args, "key_dir", None):
            shutil.rmtree(args.key_dir, ignore_errors=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo serve`` to the main parser's subcommands."""
    p = sub.add_parser(
        "serve",
        help="serve trained agents (OpenAI-compatible API + chat page) on Ray Serve",
        description="Each MODEL is a model folder, a training checkpoint (a folder with policy/), a "
        "run folder (its newest checkpoint) or a registered model name; NAME=MODEL sets "
        "the name clients pass as `model`. Tools run server-side with the same code and "
        "sandbox as training.",
    )
    p.add_argument("models", nargs="+", metavar="MODEL_OR_CHECKPOINT")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replicas", type=int, default=1, help="replicas (each holds every agent)")
    p.add_argument("--autoscale", action="store_true", help="autoscale replicas (serve.app.AUTOSCALING)")
    p.add_argument(
        "--replica-resources",
        default=None,
        dest="replica_resources",
        help="Ray custom resources each replica asks for, as JSON (e.g. '{\"worker\": 1}'): replicas "
        "run only on nodes offering them; checked against the cluster before Serve starts",
    )
    p.add_argument(
        "--max-replicas-per-node",
        type=int,
        default=None,
        dest="max_replicas_per_node",
        help="at most this many replicas on one node (1 spreads --replicas over that many nodes)",
    )
    p.add_argument("--tools", help='python,search or a JSON tool spec ({"python": {"timeout_s": 5}})')
    p.add_argument(
        "--max-tool-calls",
        type=int,
        dest="max_tool_calls",
        help="tool calls per conversation (default: the training limit of a checkpoint or of a "
        "policy folder arpo wrote, else 4)",
    )
    p.add_argument("--engine", choices=engine_names(), default="hf")
    p.add_argument(
        "--system-prompt",
        dest="system_prompt",
        help="system prompt added when a request has none (default: the training prompt of a checkpoint "
        "or of a policy folder arpo wrote, else the protocol's)",
    )
    p.add_argument(
        "--protocol",
        default=None,
        help="how the agent writes tool calls, arpo or json (default: the training protocol of a "
        "checkpoint or of a policy folder arpo wrote, else arpo)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        dest="max_tokens",
        help="default max_tokens of a request (whole response, tool results included)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=4096,
        dest="max_tokens_limit",
        help="the largest max_tokens a request may ask for (HTTP 400 beyond; default 4096)",
    )
    p.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=16,
        dest="max_ongoing_requests",
        help="requests a replica works on at once (they share engine rounds)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=32,
        dest="max_queued_requests",
        help="requests waiting in a replica beyond that; more get HTTP 503 + Retry-After",
    )
    p.add_argument(
        "--api-key",
        dest="api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* but /v1/agents (default: $ARPO_API_KEY; visible in the "
        "process list: prefer the variable or --api-key-file)",
    )
    p.add_argument("--api-key-file", dest="api_key_file", default=None, help="read the API key from this file")
    from serve.admin import CHANGE_TIMEOUT_S, MAX_AGENTS, MAX_AGENTS_PER_CHANGE

    p.add_argument(
        "--admin-key",
        dest="admin_key",
        default=None,
        help="enable live agent changes (POST/GET /v1/agents) with this key, never the API key (default: "
        "$ARPO_ADMIN_KEY; without one, live changes are off)",
    )
    p.add_argument("--admin-key-file", dest="admin_key_file", default=None, help="read the admin key from this file")
    p.add_argument(
        "--admin-root",
        dest="admin_root",
        action="append",
        default=None,
        help="a folder live changes may load agents from (repeatable; required with an admin key)",
    )
    p.add_argument(
        "--admin-max-per-change",
        type=int,
        default=MAX_AGENTS_PER_CHANGE,
        dest="admin_max_per_change",
        help=f"agents one live change may add (default {MAX_AGENTS_PER_CHANGE})",
    )
    p.add_argument(
        "--admin-max-agents",
        type=int,
        default=MAX_AGENTS,
        dest="admin_max_agents",
        help=f"agents served after a live change (default {MAX_AGENTS})",
    )
    p.add_argument(
        "--admin-memory-budget",
        type=float,
        default=None,
        dest="admin_memory_budget",
        help="GiB of weights the agents may hold after a live change (a shared base once); a change over it is "
        "refused before anything loads (default: no budget)",
    )
    p.add_argument(
        "--admin-timeout",
        type=float,
        default=CHANGE_TIMEOUT_S,
        dest="admin_timeout",
        help=f"seconds a live change may take to load in every replica (504 beyond, nothing changed; default "
        f"{CHANGE_TIMEOUT_S:g})",
    )
    from serve.record import DEFAULT_MAX_BYTES, DEFAULT_REWARD_DEADLINE_S

    p.add_argument(
        "--record",
        default=None,
        metavar="DIR",
        help="record every request that names an episode (arpo.episode or the arpo-episode header) into DIR, "
        "token for token, for training (off by default; DIR is made 0700, one others may write is refused)",
    )
    p.add_argument(
        "--record-max-gib",
        type=float,
        default=DEFAULT_MAX_BYTES / 1024**3,
        dest="record_max_gib",
        help=f"size cap of the record folder in GiB; beyond it new turns are served but not recorded (default "
        f"{DEFAULT_MAX_BYTES / 1024**3:g})",
    )
    p.add_argument(
        "--reward-deadline",
        type=float,
        default=DEFAULT_REWARD_DEADLINE_S,
        dest="reward_deadline",
        help="seconds after an episode's last turn its reward may arrive; later it is refused and the episode "
        f"dropped from training (default {DEFAULT_REWARD_DEADLINE_S:g})",
    )
    p.add_argument(
        "--rewards-key",
        dest="rewards_key",
        default=None,
        help="enable POST /v1/rewards with this key, never the API or admin key (default: $ARPO_REWARDS_KEY; "
        "without one, rewards by API are off)",
    )
    p.add_argument(
        "--rewards-key-file", dest="rewards_key_file", default=None, help="read the rewards key from this file"
    )
    p.add_argument(
        "--allowed-hosts",
        dest="allowed_hosts",
        default=None,
        help="host names clients use (Host header), comma-separated; required off loopback",
    )
    p.add_argument("--tls-cert", dest="tls_cert", default=None, help="PEM certificate: serve HTTPS")
    p.add_argument("--tls-key", dest="tls_key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        dest="request_timeout",
        help="seconds one request may take, tool calls included (504 beyond; default 300)",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, dest="ready_timeout")
    p.add_argument(
        "--allow-unisolated-python",
        action="store_true",
        dest="allow_unisolated_python",
        help="serve a Python tool below the 'process' isolation level (the model's code may reach the "
        "network or act as the server's user); refused without this flag",
    )
    p.set_defaults(func=cmd_serve)
