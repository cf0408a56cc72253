"""A persistent, content-addressed tool-result cache (SQLite, WAL mode) shared safely by processes and threads.

The key is ``sha256`` of the canonical JSON ``{"tool": name, "args": normalized args}``; a tool may define
``normalize_args(kwargs)`` (the search tool strips the query and removes ``"``, like the reference cache). Only
successful results are stored: errors and timeouts are transient and must be retried. Every write is a single
transaction, so a crash leaves either the old or the new row; ``busy_timeout`` makes concurrent writers wait instead
of failing. This replaces the reference's JSON file + ``fcntl`` lock + periodic reload
(docs/concepts/reference-choices.md#training-search), and can import and
export that JSON format (cleaned query -> formatted text) for the search tool.

Modes:
    ``read_write``: serve hits, store new results.
    ``read_only``: offline replay. Hits are served; on a miss ``on_miss="run"`` runs the tool without storing the
        result, ``on_miss="error"`` returns ``ToolResult(error=True)`` saying the call is not in the cache.
    ``off``: the cache is bypassed entirely (no lookups, no writes, nothing counted).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from arpo_base.errors import ConfigError, MissingDataError
from arpo_env.tools.base import Tool, ToolResult

MODES = ("read_write", "read_only", "off")
ON_MISS = ("run", "error")
_SCHEMA = """CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY, tool TEXT NOT NULL, args TEXT NOT NULL, text TEXT NOT NULL,
    meta TEXT NOT NULL, created REAL NOT NULL)"""


def cache_key(tool: str, args: dict) -> str:
    """Content address of a call: sha256 of canonical JSON (sorted keys, no whitespace, UTF-8)."""
    canonical = json.dumps({"tool": tool, "args": args}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class ToolCache:
    """The on-disk cache. One instance may be used from many threads; many processes may open the same file."""

    def __init__(
        self, path: str | os.PathLike, mode: str = "read_write", on_miss: str = "run", busy_timeout_s: float = 30.0
    ) -> None:
        """Open (and create, in ``read_write`` mode) the cache file.

        Args:
            path: SQLite file.
            mode: ``"read_write"``, ``"read_only"`` or ``"off"``.
            on_miss: In ``read_only`` mode, ``"run"`` the tool (result not stored) or return an ``"error"``.
            busy_timeout_s: How long a writer waits for another process's transaction.
        """
        if mode not in MODES:
            raise ConfigError(f"unknown cache mode {mode!r}; choose one of {MODES}")
        if on_miss not in ON_MISS:
            raise ConfigError(f"unknown cache on_miss {on_miss!r}; choose one of {ON_MISS}")
        self.path, self.mode, self.on_miss = Path(path), mode, on_miss
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._stats = {"hits": 0, "misses": 0, "writes": 0}
        if mode == "read_only" and not self.path.exists():
            raise MissingDataError(f"read_only tool cache not found: {self.path}")
        if mode == "read_write":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._conn() as conn:
                conn.execute(_SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        # One connection per thread and per process: sqlite3 connections must not cross threads or a fork.
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            if self.mode == "read_only":
                conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=self.busy_timeout_s)
            else:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def get(self, tool: str, args: dict) -> ToolResult | None:
        """The cached result of ``tool(**args)`` (``cache_hit=True``), or None. Counts a hit or a miss."""
        if self.mode == "off":
            return None
        row = self._conn().execute("SELECT text, meta FROM results WHERE key = ?", (cache_key(tool, args),)).fetchone()
        if row is None:
            self._count("misses")
            return None
        self._count("hits")
        return ToolResult(text=row[0], cache_hit=True, meta=json.loads(row[1]))

    def put(self, tool: str, args: dict, result: ToolResult) -> bool:
        """Store a successful result (``read_write`` mode only). Returns whether it was written."""
        if self.mode != "read_write" or result.error:
            return False
        self._put_many([(tool, args, result.text, result.meta)])
        return True

    def _put_many(self, rows: list[tuple[str, dict, str, dict]]) -> None:
        conn = self._conn()
        with conn:  # one transaction: all rows or none
            conn.executemany(
                "INSERT OR REPLACE INTO results (key, tool, args, text, meta, created) VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (
                        cache_key(t, a),
                        t,
                        json.dumps(a, sort_keys=True, ensure_ascii=False),
                        text,
                        json.dumps(meta, default=str),
                        time.time(),
                    )
                    for t, a, text, meta in rows
                ],
            )
        self._count("writes", len(rows))

    def stats(self) -> dict[str, Any]:
        """Hits, misses and writes of this instance, the hit rate, and the number of rows in the file."""
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else 0.0
        out["entries"] = 0 if self.mode == "off" else self._conn().execute("SELECT COUNT(*) FROM results").fetchone()[0]
        return out

    def import_reference_json(self, path: str | os.PathLike, tool: str = "search") -> int:
        """Import a reference ``search_cache.json`` (query -> formatted text). Returns the number of entries."""
        if self.mode != "read_write":
            raise ConfigError(f"cannot import into a cache opened in {self.mode!r} mode; use mode='read_write'")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ConfigError(f"{path} is not a JSON object mapping queries to result strings")
        # Keys are stored cleaned exactly as SearchTool.normalize_args cleans queries, so replayed calls hit.
        rows: list[tuple[str, dict, str, dict]] = [
            (tool, {"query": k.replace('"', "").strip()}, v, {}) for k, v in data.items()
        ]
        self._put_many(rows)
        return len(rows)

    def export_reference_json(self, path: str | os.PathLike, tool: str = "search") -> int:
        """Write all results of ``tool`` called with a single ``query`` argument as a reference-format JSON file."""
        out: dict[str, str] = {}
        for args, text in self._conn().execute(
            "SELECT args, text FROM results WHERE tool = ? ORDER BY created", (tool,)
        ):
            parsed = json.loads(args)
            if set(parsed) == {"query"}:
                out[parsed["query"]] = text
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(out, ensure_ascii=False, indent=1), encoding="utf-8")
        tmp.replace(path)  # atomic: readers never see a half-written file
        return len(out)

    def close(self) -> None:
        """Close this thread's connection (other threads' connections close when they are collected)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class CachedTool:
    """Wraps any tool with a ``ToolCache``; same name and schema, ``ToolResult.cache_hit`` set on hits."""

    def __init__(self, tool: Tool, cache: ToolCache) -> None:
        """Wrap ``tool``.

        Args:
            tool: The tool to cache.
            cache: The cache (may be shared by several tools; the tool name is part of the key).
        """
        self.tool, self.cache, self.name = tool, cache, tool.name

    def schema(self) -> dict:
        """The wrapped tool's schema."""
        return self.tool.schema()

    def __call__(self, **kwargs: Any) -> ToolResult:
        """Serve from the cache, or run the tool (and store the result, depending on the mode)."""
        if self.cache.mode == "off":
            return self.tool(**kwargs)
        start = time.monotonic()
        normalize = getattr(self.tool, "normalize_args", None)  # optional hook of the Tool protocol
        args = normalize(kwargs) if normalize is not None else kwargs
        try:
            hit = self.cache.get(self.name, args)
        except (TypeError, ValueError):  # arguments that cannot be JSON-encoded: let the tool reject them
            return self.tool(**kwargs)
        except sqlite3.Error as exc:
            return ToolResult(text=f"Tool cache failure: {exc}", error=True)
        if hit is not None:
            hit.latency_s = time.monotonic() - start
            return hit
        if self.cache.mode == "read_only" and self.cache.on_miss == "error":
            return ToolResult(
                text=f"Not in the tool cache (read_only mode, on_miss='error'): {self.name} call "
                f"{json.dumps(args, ensure_ascii=False)[:200]}",
                error=True,
                latency_s=time.monotonic() - start,
                meta={"cache_miss": True},
            )
        result = self.tool(**kwargs)
        try:
            self.cache.put(self.name, args, result)
        except sqlite3.Error as exc:  # a full disk must not break the rollout: report it on the result
            result.meta["cache_write_error"] = str(exc)
        result.meta["cache_miss"] = True  # after put: a later hit must not claim to be a miss
        return result
