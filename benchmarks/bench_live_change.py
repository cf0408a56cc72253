"""The cost of admitting a live agent change: ``arpo serve`` started as a user starts it, then one
``POST /v1/agents`` adding an adapter agent, timed from the request to the new agent's first answer.

    python -m benchmarks.bench_live_change [--model tiny|smollm2-135m-instruct|FOLDER] [--replicas 1]
                                           [--rank 16] [--out FILE]

The base is served as ``base``; the added agent is a random rank-``--rank`` LoRA adapter of it made here, under the
server's ``--admin-root`` (a temporary folder). Reported: ``change_s`` (the request until its answer: checks, every
replica loading the adapter beside what it serves, the commit), ``first_answer_s`` (the new agent's first chat
answer, 4 tokens) and ``total_s`` (the two). One run; the server's own start is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base(model: str, root: Path) -> Path:
    from arpo_algo.models import build_tiny_model, resolve_model_path

    if model == "tiny":
        return build_tiny_model(root / "base", num_layers=2, hidden_size=64, seed=0)
    src = Path(model) if Path(model).is_dir() else Path(resolve_model_path(model))
    return Path(shutil.copytree(src, root / "base", symlinks=False))  # under the admin root, links resolved


def run(model: str, replicas: int, rank: int, ready_timeout_s: float = 600.0) -> dict:
    from arpo_algo.models import build_tiny_adapter
    from arpo_base.http import bearer, request
    from serve.cli.serve import wait_ready

    root = Path(tempfile.mkdtemp(prefix="arpo-live-change-"))
    try:
        base = _base(model, root)
        adapter = build_tiny_adapter(base, root / "added", rank=rank, seed=1)
        key, admin = secrets.token_hex(16), secrets.token_hex(16)
        port = _free_port()
        env = {**os.environ, "ARPO_API_KEY": key, "ARPO_ADMIN_KEY": admin, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "arpo_algo.cli", "serve", f"base={base}", "--port", str(port)]
        cmd += ["--replicas", str(replicas), "--max-tokens", "4", "--tools", "python", "--max-tool-calls", "0"]
        cmd += ["--admin-root", str(root), "--ready-timeout", str(ready_timeout_s)]
        log = open(root / "serve.log", "wb")  # noqa: SIM115 - closed below, after the server stopped
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_timeout_s
            while b"serving " not in (root / "serve.log").read_bytes():  # the owner polls once start() returned
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((root / "serve.log").read_text(errors="replace")[-3000:])
                time.sleep(0.5)
            wait_ready(url, 60, key)
            t0 = time.perf_counter()
            out = request(
                "POST", f"{url}/v1/agents", {"add": [f"added={adapter}"]}, headers=bearer(admin), timeout=900
            ).data
            t1 = time.perf_counter()
            body = {"model": "added", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            answer = request("POST", f"{url}/v1/chat/completions", body, headers=bearer(key), timeout=300).data
            t2 = time.perf_counter()
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
        assert out["models"] == ["base", "added"] and answer["choices"], (out, answer)
        return {
            "model": model,
            "replicas": replicas,
            "rank": rank,
            "change_s": round(t1 - t0, 3),
            "first_answer_s": round(t2 - t1, 3),
            "total_s": round(t2 - t0, 3),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, a registered model name or a model folder")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    result = run(args.model, args.replicas, args.rank)
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
