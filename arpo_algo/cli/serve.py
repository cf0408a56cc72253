"""``arpo serve``: host trained agents behind an OpenAI-compatible API on Ray Serve (the app is :mod:`serve.app`)."""

from __future__ import annotations

import argparse
import json
import signal
import time
import urllib.error
import urllib.request

from arpo_base.errors import ArpoError


def wait_ready(url: str, timeout_s: float) -> dict:
    """Poll ``GET url/health`` until it answers 200 (models loaded); raise naming the last answer otherwise."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            last = e.read().decode(errors="replace")
            if '"error"' in last:
                raise ArpoError(f"the agents failed to load: {last}") from None
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.5)
    raise ArpoError(f"the server did not become ready within {timeout_s:.0f} s ({last})")


def start(args: argparse.Namespace) -> str:
    """Start Ray (if needed), Serve on ``host:port`` and the application; return the base URL once ready."""
    import ray
    from ray import serve

    from serve.agents import build_specs
    from serve.app import build_app

    specs = build_specs(args.models, tools=args.tools, max_tool_calls=args.max_tool_calls, engine=args.engine,
                        system_prompt=args.system_prompt, max_tokens=args.max_tokens)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(specs, replicas=args.replicas, max_ongoing_requests=args.max_ongoing_requests,
                    max_queued_requests=args.max_queued_requests, autoscale=args.autoscale)
    serve.run(app, name="arpo", route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    health = wait_ready(url, args.ready_timeout)
    print(f"serving {', '.join(health['models'])} at {url}  (chat page: {url}/ , API: {url}/v1/chat/completions)")
    return url


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

    on_signals()
    try:
        start(args)
        on_signals()  # again: ray.init installs its own SIGTERM handler, which exits without shutting Serve down
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo serve`` to the main parser's subcommands."""
    p = sub.add_parser("serve", help="serve trained agents (OpenAI-compatible API + chat page) on Ray Serve",
                       description="Each MODEL is a model folder, a training checkpoint (a folder with policy/), a "
                                   "run folder (its newest checkpoint) or a registered model name; NAME=MODEL sets "
                                   "the name clients pass as `model`. Tools run server-side with the same code and "
                                   "sandbox as training.")
    p.add_argument("models", nargs="+", metavar="MODEL_OR_CHECKPOINT")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replicas", type=int, default=1, help="replicas (each holds every agent)")
    p.add_argument("--autoscale", action="store_true", help="autoscale replicas (serve.app.AUTOSCALING)")
    p.add_argument("--tools", help='python,search or a JSON tool spec ({"python": {"timeout_s": 5}})')
    p.add_argument("--max-tool-calls", type=int, dest="max_tool_calls", help="tool calls per conversation")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--system-prompt", dest="system_prompt", help="system prompt added when a request has none")
    p.add_argument("--max-tokens", type=int, default=512, dest="max_tokens",
                   help="default max_tokens of a request (whole response, tool results included)")
    p.add_argument("--max-ongoing-requests", type=int, default=16, dest="max_ongoing_requests",
                   help="requests a replica works on at once (they share engine rounds)")
    p.add_argument("--max-queued-requests", type=int, default=32, dest="max_queued_requests",
                   help="requests waiting at the proxy beyond that; more get HTTP 503 + Retry-After")
    p.add_argument("--ready-timeout", type=float, default=600.0, dest="ready_timeout")
    p.set_defaults(func=cmd_serve)
