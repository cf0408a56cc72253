"""Tool throughput benchmark: sandboxed Python calls/s, BM25 latency on 100k synthetic docs, cache-hit latency.

Run: ``python -m benchmarks.bench_tools --out bench_tools.json`` (prints a markdown table).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from arpo_env.tools import BM25Backend, CachedTool, PythonTool, SearchTool, ToolCache, sandbox_capabilities


def _synthetic_docs(n: int, seed: int = 0, vocab_size: int = 20_000, words: int = 60) -> list[dict]:
    """Deterministic documents from a Zipf-like vocabulary of made-up words."""
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(vocab_size)
    ]
    weights = [1.0 / (rank + 1) for rank in range(vocab_size)]
    return [
        {
            "id": str(i),
            "title": " ".join(rng.choices(vocab, weights, k=3)),
            "text": " ".join(rng.choices(vocab, weights, k=words)),
        }
        for i in range(n)
    ], vocab


def bench_python(calls: int) -> dict:
    tool = PythonTool(timeout_s=10, backend="subprocess")
    code = "sum(i * i for i in range(1000))"
    start = time.perf_counter()
    results = [tool(code) for _ in range(calls)]
    sequential = calls / (time.perf_counter() - start)
    start = time.perf_counter()
    results += tool.run_many([code] * (calls * 2), max_workers=8)
    concurrent = 2 * calls / (time.perf_counter() - start)
    errors = [r.text for r in results if r.error]
    return {
        "python_calls_per_s_sequential": sequential,
        "python_calls_per_s_8_concurrent": concurrent,
        "python_errors": len(errors),
        "python_first_error": errors[0][:300] if errors else None,
    }


def bench_bm25(n_docs: int, queries: int) -> dict:
    docs, vocab = _synthetic_docs(n_docs)
    start = time.perf_counter()
    tool = SearchTool(BM25Backend(documents=docs))
    build = time.perf_counter() - start
    rng = random.Random(1)
    latencies = []
    for _ in range(queries):
        query = " ".join(rng.choices(vocab[:5000], k=4))
        t0 = time.perf_counter()
        assert not tool(query=query).error
        latencies.append(time.perf_counter() - t0)
    latencies.sort()
    return {
        "bm25_docs": n_docs,
        "bm25_index_build_s": build,
        "bm25_query_ms_median": 1e3 * statistics.median(latencies),
        "bm25_query_ms_p95": 1e3 * latencies[int(0.95 * (len(latencies) - 1))],
    }


def bench_cache(lookups: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        docs, _ = _synthetic_docs(200)
        tool = CachedTool(SearchTool(BM25Backend(documents=docs)), ToolCache(Path(tmp) / "c.sqlite"))
        queries = [docs[i]["title"] for i in range(100)]
        for q in queries:
            tool(query=q)
        latencies = []
        for i in range(lookups):
            t0 = time.perf_counter()
            assert tool(query=queries[i % len(queries)]).cache_hit
            latencies.append(time.perf_counter() - t0)
    return {"cache_hit_us_median": 1e6 * statistics.median(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--python-calls", type=int, default=40)
    parser.add_argument("--bm25-docs", type=int, default=100_000)
    parser.add_argument("--bm25-queries", type=int, default=200)
    parser.add_argument("--cache-lookups", type=int, default=2000)
    args = parser.parse_args()
    results = {"machine": platform.platform(), "sandbox": sandbox_capabilities("subprocess")}
    results.update(bench_python(args.python_calls))
    results.update(bench_bm25(args.bm25_docs, args.bm25_queries))
    results.update(bench_cache(args.cache_lookups))
    print("| metric | value |\n|---|---|")
    for key, value in results.items():
        if isinstance(value, float | int) and not isinstance(value, bool):
            print(f"| {key} | {value:.3g} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
