"""ToolCache: SQLite persistence across processes, modes, and the reference JSON format round trip."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from arpo_base.errors import ConfigError
from arpo_env.tools import CachedTool, PythonTool, SearchTool, ToolCache, build_tools
from arpo_env.tools.base import ToolResult
from arpo_env.tools.search import ReplayBackend


def _writer(path: str, worker: int, n: int) -> None:
    cache = ToolCache(path, busy_timeout_s=60)
    for i in range(n):
        cache.put("calc", {"i": i, "worker": worker}, ToolResult(text=f"{worker}:{i}"))
        cache.put("calc", {"shared": i}, ToolResult(text=f"shared {i}"))  # every process writes these keys


def test_concurrent_writers_from_processes(tmp_path):
    path = str(tmp_path / "cache.sqlite")
    ToolCache(path)  # create the schema once
    ctx = mp.get_context("spawn")  # a fresh interpreter per writer, like Ray workers
    procs = [ctx.Process(target=_writer, args=(path, w, 50)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    cache = ToolCache(path, mode="read_only")
    assert cache.stats()["entries"] == 4 * 50 + 50
    assert cache.get("calc", {"worker": 3, "i": 49}).text == "3:49"  # key independent of argument order
    assert cache.get("calc", {"shared": 7}).text == "shared 7"


def test_cached_tool_read_write_hits(tmp_path):
    cache = ToolCache(tmp_path / "c.sqlite")
    tool = CachedTool(PythonTool(timeout_s=5, backend="subprocess"), cache)
    first = tool(code="import random\nrandom.random()")
    second = tool(code="import random\nrandom.random()")
    assert not first.cache_hit and second.cache_hit and first.text == second.text
    assert "cache_miss" not in second.meta
    failing = tool(code="1/0")
    assert failing.error and not tool(code="1/0").cache_hit  # errors are never stored
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (1, 3, 1)


def test_read_only_and_off_modes(tmp_path):
    path = tmp_path / "c.sqlite"
    python = PythonTool(timeout_s=5, backend="subprocess")
    CachedTool(python, ToolCache(path))(code="6 * 7")
    ro_error = CachedTool(python, ToolCache(path, mode="read_only", on_miss="error"))
    assert ro_error(code="6 * 7").cache_hit
    miss = ro_error(code="6 * 8")
    assert miss.error and "Not in the tool cache" in miss.text
    ro_run = CachedTool(python, ToolCache(path, mode="read_only", on_miss="run"))
    ran = ro_run(code="6 * 8")
    assert ran.text == "48" and not ran.cache_hit and ro_run.cache.stats()["entries"] == 1  # nothing stored
    off = CachedTool(python, ToolCache(path, mode="off"))
    assert not off(code="6 * 7").cache_hit and off.cache.stats()["hits"] == 0
    with pytest.raises(ConfigError, match="mode"):
        ToolCache(path, mode="rw")
    with pytest.raises(ConfigError, match="on_miss"):
        ToolCache(path, on_miss="skip")


def test_reference_json_round_trip(tmp_path, shared_data):
    source = shared_data / "search_cache.json"
    raw = json.loads(source.read_text(encoding="utf-8"))
    cache = ToolCache(tmp_path / "c.sqlite")
    assert cache.import_reference_json(source) == len(raw)
    out = tmp_path / "export.json"
    assert cache.export_reference_json(out) == len(raw)
    assert json.loads(out.read_text(encoding="utf-8")) == {k.replace('"', "").strip(): v for k, v in raw.items()}
    # The imported cache serves the search tool with no backend data at all (empty replay file).
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    tool = CachedTool(
        SearchTool(ReplayBackend(empty)), ToolCache(tmp_path / "c.sqlite", mode="read_only", on_miss="error")
    )
    key = next(iter(raw))
    hit = tool(query=f"  {key} ")
    assert hit.cache_hit and hit.text == raw[key]


def test_build_tools_with_cache(tmp_path, shared_data):
    tools = build_tools(
        {
            "search": {"backend": "replay", "cache_json": str(shared_data / "search_cache.json")},
            "cache": {"path": str(tmp_path / "t.sqlite"), "mode": "read_write"},
        }
    )
    query = next(iter(json.loads((shared_data / "search_cache.json").read_text())))
    assert not tools["search"](query=query).cache_hit and tools["search"](query=query).cache_hit
    with pytest.raises(ConfigError, match="tools.cache: unknown key 'size'"):
        build_tools({"cache": {"path": str(tmp_path / "t.sqlite"), "size": 3}})
