"""What recording episodes (``arpo serve --record``) costs serving, measured in one run.

One served agent (the HF engine behind the replica's batching front, in this process: the HTTP layer in front is
the same with and without recording) answers rounds of ``--clients`` concurrent client conversations of
``--turns`` turns each, every turn sending the history back with the reply it chose. Rounds alternate recording on
and off in the order on, off, off, on, ... (drift of a shared machine falls on both sides); recording on, each
conversation is an episode, so turns after the first are rendered from the recorded ids and every turn's log-probs
are asked of the engine. Reported: completion tokens per second on each side (summed over the timed rounds) and
their ratio, with the CPU flags; and the time the recorder itself took (rendering a continued prompt, writing and
fsyncing the turn; timed around it) as a share of the recorded rounds' wall time: the direct measure, which the
noise of a shared machine does not blur.

    python -m benchmarks.bench_record_serve --pairs 3 --out record_serve.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.bench_record_trees import cpu_flags


def timed_recorder(config: Any) -> Any:
    """A :class:`serve.record.Recorder` that adds the seconds its request-path work takes to ``spent``."""
    from serve.record import Recorder

    class Timed(Recorder):
        spent = 0.0
        lock = threading.Lock()

        def _timed(self, fn: Any, *a: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                with self.lock:
                    Timed.spent += time.perf_counter() - t

        def render(self, *a: Any) -> Any:
            return self._timed(super().render, *a)

        def finish(self, *a: Any) -> Any:
            return self._timed(super().finish, *a)

    return Timed(config)


def _conversation(agent: Any, recorder: Any, episode: str, turns: int, max_tokens: int) -> int:
    """One client's conversation; returns its completion tokens."""
    from serve.schema import parse_chat_request

    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Compute {episode}."}]
    tokens = 0
    for k in range(turns):
        body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": max_tokens}
        if recorder is not None:
            body["arpo"] = {"episode": episode}
        job = agent.prepare(parse_chat_request(json.dumps(body)), recorder, "bench")
        out = agent.run(job, threading.Event())
        tokens += out["usage"]["completion_tokens"]
        reply = out["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": f"next {k}"}]
    return tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from arpo_algo.models import build_tiny_model
    from serve.agents import AgentSpec
    from serve.batching import BatchingEngine
    from serve.record import RecordConfig
    from serve.runtime import Agent

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an HF model folder (default: a tiny Llama built here)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent conversations per round")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    ap.add_argument("--pairs", type=int, default=3, help="timed rounds with recording (and as many without)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="arpo-record-serve-") as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny", num_layers=2, hidden_size=128, seed=0))
        from arpo_algo.rollout.engines import build_engine

        front = BatchingEngine(build_engine("hf", model_or_path=model))
        agent = Agent(AgentSpec(name="m", model_path=model, session={"tools": {"python": {}}}), front=front)
        recorder = timed_recorder(RecordConfig(str(Path(tmp) / "episodes")))
        order = (["on", "off", "off", "on"] * args.pairs)[: 2 * args.pairs]
        totals = {"on": [0, 0.0], "off": [0, 0.0]}  # tokens, seconds
        pool = ThreadPoolExecutor(args.clients)
        try:
            for i in range(args.warmup + len(order)):
                mode = "on" if i < args.warmup else order[i - args.warmup]
                rec = recorder if mode == "on" else None
                if i == args.warmup:
                    type(recorder).spent = 0.0  # the timed rounds only
                t = time.perf_counter()
                futures = [
                    pool.submit(_conversation, agent, rec, f"r{i}c{c}", args.turns, args.max_tokens)
                    for c in range(args.clients)
                ]
                tokens = sum(f.result() for f in futures)
                if i >= args.warmup:
                    totals[mode][0] += tokens
                    totals[mode][1] += time.perf_counter() - t
        finally:
            pool.shutdown()
            front.close()
    rate = {m: tok / s for m, (tok, s) in totals.items()}
    result = {
        "tokens_per_s_on": rate["on"],
        "tokens_per_s_off": rate["off"],
        "ratio_on_off": rate["on"] / rate["off"],
        "tokens_on": totals["on"][0],
        "tokens_off": totals["off"][0],
        "recorder_s": type(recorder).spent,
        "recorder_share_on": type(recorder).spent / totals["on"][1],
        "turns_recorded": recorder.counts["turns"],
        "turns_continued": recorder.counts["continued"],
        "clients": args.clients,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "pairs": args.pairs,
        "threads": args.threads,
        "cpu": cpu_flags(),
        "torch": torch.__version__,
    }
    print(
        f"recording on: {rate['on']:.1f} tok/s, off: {rate['off']:.1f} tok/s, ratio on/off {result['ratio_on_off']:.3f}"
        f" ({result['turns_continued']} of {result['turns_recorded']} recorded turns continued their episode);"
        f" the recorder's own work: {result['recorder_s']:.3f} s, {100 * result['recorder_share_on']:.2f} % of the"
        " recorded rounds' wall time"
        f"\n{args.clients} clients x {args.turns} turns, max_tokens {args.max_tokens}, {args.pairs} pairs; "
        f"{args.threads} torch threads; CPU flags: {result['cpu']}; torch {result['torch']}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
