"""Serving benchmark: requests/s and p50/p99 latency of ``arpo serve`` at 1, 8 and 32 concurrent clients, and the
served throughput against in-process generation of the same requests.

    python -m benchmarks.bench_serve                      # SmolLM2-135M-Instruct on CPU (arpo model pull first)
    python -m benchmarks.bench_serve --clients 1,8 --requests-per-client 2 --max-tokens 16   # shorter
    python -m benchmarks.bench_serve --model runs/quickstart/sft --engine vllm --toolmath-level 3 --clients 1,4 \
        --max-tokens 192        # an SFT checkpoint on held-out ToolMath questions (it calls the tool), vLLM engine
    python -m benchmarks.bench_serve --model tiny --compare-checks --clients 1,32 --max-tokens 4 --no-in-process
                                # what the security checks cost: the same run with and without them, and the ratio

``--model tiny`` builds a tiny random Llama (no download). ``--compare-checks`` serves the requests twice, with the
checks and with them switched off, and prints the latency ratio per client count. The checks are those ``arpo serve``
runs: the gate in front of Serve's proxy (:class:`serve.proxy.Gate`: ``x-request-*`` headers stripped, Host, Origin,
key and content type checked, the body read under a deadline and a size limit before Serve queues the request) and
the replica's own (:mod:`serve.guard`); the side without them keeps Serve's proxy and the lost-replica answer.

Every request is a seeded chat completion (``temperature`` 1, ``seed`` = request index), so the served run and the
in-process run generate exactly the same tokens: the comparison is the same work. Clients are closed loops (each
sends its next request when the previous one returns) through HTTP on 127.0.0.1 with the official ``openai``
client. The in-process baseline runs the same agent loop (``run_agents``) on an in-process engine, ``C``
conversations at a time for ``C`` clients (what perfect batching of ``C`` concurrent requests could reach), with no
HTTP and no Serve. Both sides use ``--threads`` torch threads (the replica gets that many Ray CPUs, so Ray sets its
``OMP_NUM_THREADS``); on a busy machine one thread is far faster than an oversubscribed two.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import threading
import time
from typing import Any

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
    "List three uses of Python.",
    "Describe a cat in two sentences.",
    "What is the capital of France? Explain briefly.",
    "Give advice for learning to cook.",
    "Summarise the water cycle.",
    "Why is the sky blue?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests_for(level: int, per_client: int, toolmath_level: int | None = None) -> list[dict[str, Any]]:
    """``level * per_client`` seeded requests: the PROMPTS, or held-out ToolMath questions of one level (the env's
    messages, its system prompt included)."""
    if toolmath_level is None:
        return [
            {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "seed": i}
            for i in range(level * per_client)
        ]
    from arpo_env.core import ToolTextEnv

    env = ToolTextEnv({"task": "toolmath", "levels": [toolmath_level], "split": "test", "tools": {"python": {}}})
    return [
        {"messages": env.reset(options={"task_index": i})[1]["messages"], "seed": i} for i in range(level * per_client)
    ]


def pct(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def served(
    url: str, model: str, reqs: list[dict], clients: int, max_tokens: int, key: str = "unused"
) -> dict[str, float]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    todo = list(enumerate(reqs))
    lock = threading.Lock()
    lat: list[float] = []
    tokens = [0]

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                _, r = todo.pop(0)
            t = time.perf_counter()
            out = client.chat.completions.create(
                model=model, messages=r["messages"], seed=r["seed"], temperature=1.0, max_tokens=max_tokens
            )
            with lock:
                lat.append(time.perf_counter() - t)
                tokens[0] += out.usage.completion_tokens

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "requests": len(reqs),
        "wall_s": wall,
        "req_per_s": len(reqs) / wall,
        "tokens": tokens[0],
        "p50_s": statistics.median(lat),
        "p99_s": pct(lat, 0.99),
        "latencies": lat,
    }


def in_process(agent: Any, reqs: list[dict], clients: int, max_tokens: int) -> dict[str, float]:
    """The same requests through the same agent loop on the same engine, in this process: ``clients``
    conversations per ``run_agents`` call (lockstep rounds: perfect batching of ``clients`` concurrent requests)."""
    import functools

    from arpo_algo.rollout.agent_loop import run_agents
    from serve.runtime import choice_seed
    from serve.schema import parse_chat_request

    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), clients):
        jobs = [
            agent.prepare(
                parse_chat_request(
                    {
                        "model": "m",
                        "messages": r["messages"],
                        "seed": r["seed"],
                        "temperature": 1.0,
                        "max_tokens": max_tokens,
                    }
                )
            )
            for r in reqs[i : i + clients]
        ]
        sessions = [s for job in jobs for s in agent._sessions(job)]
        seeds = [functools.partial(choice_seed, job.seed, 0) for job in jobs]
        traces = run_agents(
            agent.front.engine,
            sessions,
            [job.prompt for job in jobs],
            jobs[0].sampling,
            max_response_tokens=jobs[0].max_response_tokens,
            seeds=seeds,
        )
        tokens += sum(len(t.response_ids) for t in traces)
    wall = time.perf_counter() - t0
    return {"requests": len(reqs), "wall_s": wall, "req_per_s": len(reqs) / wall, "tokens": tokens}


def deploy(specs: list, port: int, threads: int, checks: bool, key_file: str) -> tuple[str, dict[str, Any]]:
    """Start Serve and the bench application as ``arpo serve`` does, with or without the security checks (those of the
    replicas and those of the gate in front of Serve's proxy, which is set when Serve starts: a Serve already running
    is shut down first); return its URL once ready and what :func:`checks_in_place` saw."""
    from ray import serve

    from serve.app import build_app
    from serve.cli.serve import wait_ready
    from serve.guard import Security
    from serve.proxy import controller_options

    security = Security(key_file=key_file, port=port) if checks else Security(checks=False, port=port)
    serve.shutdown()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        proxy_location="HeadOnly",
        controller_options=controller_options(security),
    )
    serve.run(
        build_app(specs, security, max_ongoing_requests=32, max_queued_requests=64, num_cpus=threads),
        name="bench",
        route_prefix="/",
        blocking=False,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 600, read_key(key_file))
    return url, checks_in_place(url, checks)


#: Serve echoes a client's ``x-request-id`` in its answer unless the gate has stripped it.
PROBE_ID = "bench-probe-request-id"


def checks_in_place(url: str, checks: bool) -> dict[str, Any]:
    """Refuse to measure a side that is not what it claims: with the checks a request without the key is refused
    (401) and the gate strips the client's ``x-request-id`` (Serve answers with an id of its own); without them both
    pass."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/models", headers={"x-request-id": PROBE_ID})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, echoed = r.status, r.headers.get("x-request-id")
    except urllib.error.HTTPError as e:
        status, echoed = e.code, e.headers.get("x-request-id")
    seen = {"status": status, "gate": echoed != PROBE_ID}
    if seen != ({"status": 401, "gate": True} if checks else {"status": 200, "gate": False}):
        raise RuntimeError(
            f"the side {'with' if checks else 'without'} the checks is not what it claims: a request "
            f"without the key got {status}, the gate {'is' if seen['gate'] else 'is not'} in place"
        )
    return seen


def compare_checks(specs: list, port: int, key_file: str, reqs: Any, levels: list[int], args: Any) -> dict:
    """The same requests served with and without the security checks, in ``--check-rounds`` alternating passes
    (off, on, on, off, ...: neither side always runs first); p50 over the pooled latencies of each side."""
    key = read_key(key_file)
    pooled: dict[str, dict[int, list[float]]] = {m: {c: [] for c in levels} for m in ("on", "off")}
    walls: dict[str, dict[int, float]] = {m: dict.fromkeys(levels, 0.0) for m in ("on", "off")}
    sides: dict[str, dict[str, Any]] = {}
    for r in range(args.check_rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            url, sides["with" if mode == "on" else "without"] = deploy(
                specs, port, args.threads, mode == "on", key_file
            )
            for c, res in run_levels(url, key, reqs, levels, args).items():
                pooled[mode][c] += res["latencies"]
                walls[mode][c] += res["wall_s"]
    out: dict[Any, Any] = {"sides": sides}
    print(f"{'clients':>7} {'p50 with':>9} {'p50 w/o':>9} {'ratio':>6} {'req/s with':>10} {'req/s w/o':>10}")
    for c in levels:
        p50 = {m: statistics.median(pooled[m][c]) for m in pooled}
        rps = {m: len(pooled[m][c]) / walls[m][c] for m in pooled}
        out[c] = {
            "requests_each": len(pooled["on"][c]),
            "p50_s_with": p50["on"],
            "p50_s_without": p50["off"],
            "p50_ratio": p50["on"] / p50["off"],
            "req_per_s_with": rps["on"],
            "req_per_s_without": rps["off"],
        }
        print(
            f"{c:>7} {p50['on']:9.4f} {p50['off']:9.4f} {p50['on'] / p50['off']:6.3f} {rps['on']:10.2f} "
            f"{rps['off']:10.2f}",
            flush=True,
        )
    return out


def checks_work_us(key_file: str, blocks: int = 20, per_block: int = 500) -> dict[str, float]:
    """Microseconds per request of the checks' own work, in this process (no Ray, no HTTP, no model): one chat
    request through the proxy's gate and the replica's guard around an application that reads the body and answers
    200, against that application alone; blocks of each side alternate, median over blocks."""
    import asyncio

    from serve import guard, proxy

    security = guard.Security(key_file=key_file, port=8000)
    os.environ[proxy.SECURITY_ENV] = json.dumps(security.to_dict())
    try:
        gate = proxy.Gate(guard.Guard(_answer_200))
    finally:
        del os.environ[proxy.SECURITY_ENV]
    guard.install(guard.Policy(security))
    body = json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "seed": 0,
            "temperature": 1.0,
            "max_tokens": 4,
        }
    ).encode()
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"authorization", f"Bearer {read_key(key_file)}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"user-agent", b"OpenAI/Python"),
        (b"accept", b"application/json"),
    ]
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "root_path": "",
        "headers": headers,
        "query_string": b"",
    }
    times: dict[str, list[float]] = {"with": [], "without": []}
    statuses: list[int] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def run() -> None:
        for b in range(blocks):
            for side in ("with", "without") if b % 2 == 0 else ("without", "with"):
                app = gate if side == "with" else _answer_200
                t = time.perf_counter()
                for _ in range(per_block):
                    await app(dict(scope), receive, send)
                times[side].append((time.perf_counter() - t) / per_block * 1e6)

    asyncio.run(run())
    if set(statuses) != {200}:
        raise RuntimeError(f"the in-process check path did not answer 200: {sorted(set(statuses))}")
    out = {f"us_{side}": statistics.median(v) for side, v in times.items()}
    out["us_checks"] = out["us_with"] - out["us_without"]
    print(
        f"in process, per request: {out['us_with']:.1f} us with the gate and the guard, {out['us_without']:.1f} us "
        f"without ({out['us_checks']:.1f} us of checks)",
        flush=True,
    )
    return out


async def _answer_200(scope: dict, receive: Any, send: Any) -> None:
    """The application side of :func:`checks_work_us`: reads the whole body, answers 200."""
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


def read_key(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def run_levels(url: str, key: str, reqs: Any, levels: list[int], args: Any) -> dict[int, dict[str, float]]:
    served(url, "bench", reqs(1, 1), 1, args.max_tokens, key)  # warm-up
    out = {}
    for c in levels:
        out[c] = served(url, "bench", reqs(c, args.per_client), c, args.max_tokens, key)
        print(json.dumps({c: {k: v for k, v in out[c].items() if k != "latencies"}}), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--requests-per-client", type=int, default=2, dest="per_client")
    p.add_argument("--max-tokens", type=int, default=32, dest="max_tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the replica and of the in-process run")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument(
        "--toolmath-level",
        type=int,
        default=None,
        dest="toolmath_level",
        help="send held-out ToolMath questions of this level instead of the generic prompts",
    )
    p.add_argument(
        "--compare-checks",
        action="store_true",
        dest="compare_checks",
        help="serve with and without the security checks and print the latency ratio",
    )
    p.add_argument(
        "--check-rounds",
        type=int,
        default=2,
        dest="check_rounds",
        help="alternating passes per side with --compare-checks",
    )
    p.add_argument("--no-in-process", action="store_false", dest="in_process", help="skip the in-process baseline")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]

    import tempfile

    import ray
    import torch
    from ray import serve

    from serve.agents import build_specs
    from serve.runtime import Agent

    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    key_file = os.path.join(tmp, "key")
    with open(key_file, "w", encoding="utf-8") as f:
        f.write("bench-" + os.urandom(16).hex())
    key = read_key(key_file)
    if args.model == "tiny":
        from arpo_algo.models import build_tiny_model

        args.model = str(build_tiny_model(os.path.join(tmp, "tiny"), num_layers=2, hidden_size=64, seed=0))

    cpus = max(os.cpu_count() or 2, args.threads)
    torch.set_num_threads(args.threads)
    specs = build_specs(
        [f"bench={args.model}"],
        tools="python",
        max_tokens=args.max_tokens,
        engine=args.engine,
        engine_settings={"max_batch_size": 32} if args.engine == "hf" else {},
    )
    reqs = functools.partial(requests_for, toolmath_level=args.toolmath_level)
    from arpo_base.ray_start import init_ray
    from serve.cli.serve import local_ray_options

    # Ray as `arpo serve` starts it on 127.0.0.1: its own listeners on loopback too
    init_ray(num_cpus=cpus, include_dashboard=False, log_to_driver=False, **local_ray_options("127.0.0.1"))
    port = _free_port()
    out: dict[str, Any] = {
        "model": args.model,
        "engine": args.engine,
        "toolmath_level": args.toolmath_level,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "levels": {},
    }
    if args.compare_checks:
        out["checks"] = compare_checks(specs, port, key_file, reqs, levels, args)
        out["checks"]["in_process"] = checks_work_us(key_file)
        args.in_process = False
    else:
        url, _ = deploy(specs, port, args.threads, True, key_file)
        for c, res in run_levels(url, key, reqs, levels, args).items():
            out["levels"][c] = {"served": {k: v for k, v in res.items() if k != "latencies"}}
    serve.shutdown()
    ray.shutdown()
    if not args.in_process:
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=2)
        return out
    agent = Agent(specs[0])  # the in-process baseline: same loop, same engine settings, no HTTP, no Serve
    in_process(agent, reqs(1, 1), 1, args.max_tokens)  # warm-up
    for c in levels:
        base = in_process(agent, reqs(c, args.per_client), c, args.max_tokens)
        lvl = out["levels"][c]
        lvl["in_process"] = base
        lvl["served_over_in_process"] = lvl["served"]["req_per_s"] / base["req_per_s"]
        print(json.dumps({c: lvl}), flush=True)
    agent.front.close()
    print(f"{'clients':>7} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} {'in-proc req/s':>13} {'ratio':>6}")
    for c, lvl in out["levels"].items():
        s = lvl["served"]
        print(
            f"{c:>7} {s['req_per_s']:7.2f} {s['p50_s']:7.2f} {s['p99_s']:7.2f} "
            f"{lvl['in_process']['req_per_s']:13.2f} {lvl['served_over_in_process']:6.2f}"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
