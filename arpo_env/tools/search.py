"""The search tool: one ``SearchTool`` in front of three backends (offline BM25, cache replay, web over HTTP).

Results are formatted as in the reference training search (docs/concepts/reference-choices.md#training-search):
snippets are stripped, empty and duplicate
ones dropped, the first ``max_results`` (10) kept, each cut to ``result_length`` (1000) characters, and joined as
``"Page {i}: {snippet}"`` lines; with no snippet the text is ``"No search results found."``. Queries are cleaned as in
the reference (strip, remove ``"``). A backend's ``search(query)`` returns either a list of raw snippets (the tool
formats them) or a ``str`` that is already formatted (cache replay, whose entries were formatted by the reference).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from arpo_base.errors import ConfigError, MissingDataError
from arpo_base.http import HTTPJSONError, request
from arpo_base.options import check_choice
from arpo_env.tools.base import ToolResult, check_text_arg, function_schema, tolerant_call
from arpo_env.tools.registry import check_settings

NO_RESULTS = "No search results found."
QUERY_PREFIX = "search query: "  # some reference cache keys carry this literal prefix


class SearchError(Exception):
    """A backend could not answer (HTTP failure, cache miss); the message is safe to show to the model."""


class SearchBackend(Protocol):
    """Anything with ``search(query) -> list of snippets | formatted text``; raise ``SearchError`` on failure."""

    def search(self, query: str) -> list[str] | str: ...


def clean_query(query: str) -> str:
    """The reference's query normalisation: strip whitespace and remove double quotes."""
    return query.replace('"', "").strip()


def format_snippets(snippets: Iterable[str], max_results: int = 10, result_length: int = 1000) -> str:
    """Format snippets exactly as the reference training search does
    (docs/concepts/reference-choices.md#training-search)."""
    kept: list[str] = []
    for snippet in snippets:
        snippet = (snippet or "").strip()
        if snippet and snippet not in kept:
            kept.append(snippet)
        if len(kept) == max_results:
            break
    if not kept:
        return NO_RESULTS
    return "\n".join(f"Page {i}: {s[:result_length]}" for i, s in enumerate(kept, 1))


class SearchTool:
    """Search for a query and return the top snippets as ``Page i: ...`` lines."""

    name = "search"

    def __init__(
        self, backend: SearchBackend, max_results: int = 10, result_length: int = 1000, max_query_chars: int = 2000
    ) -> None:
        """Wrap a backend.

        Args:
            backend: A ``BM25Backend``, ``ReplayBackend``, ``WebBackend`` or any ``SearchBackend``.
            max_results: Snippets kept (reference: 10).
            result_length: Characters kept per snippet (reference: 1000).
            max_query_chars: Longer queries are rejected without searching.
        """
        for key, value in (
            ("max_results", max_results),
            ("result_length", result_length),
            ("max_query_chars", max_query_chars),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"search tool setting '{key}' must be a positive integer, got {value!r}")
        self.backend, self.max_results, self.result_length = backend, max_results, result_length
        self.max_query_chars = max_query_chars

    def schema(self) -> dict:
        """OpenAI/Hermes function schema for the JSON tool-call protocol."""
        return function_schema(self.name, self.__call__)

    def normalize_args(self, kwargs: dict) -> dict:
        """Cache-key normalisation: the cleaned query (what the reference cache uses as its key)."""
        query = kwargs.get("query")
        return {"query": clean_query(query)} if isinstance(query, str) and set(kwargs) == {"query"} else kwargs

    @tolerant_call
    def __call__(self, query: str) -> ToolResult:
        """Search the web (or the configured corpus) and return the top result snippets.

        Args:
            query: The search query.
        """
        start = time.monotonic()
        problem = check_text_arg(query, "query", self.max_query_chars)
        if problem is None and not clean_query(query):
            problem = "Invalid argument 'query': it is empty after removing quotes."
        if problem:
            return ToolResult(text=problem, error=True, meta={"invalid_arguments": True})
        try:
            found = self.backend.search(clean_query(query))
        except SearchError as exc:
            return ToolResult(text=str(exc), error=True, latency_s=time.monotonic() - start)
        except Exception as exc:  # a backend bug must not stop a rollout; the type name is enough to debug
            return ToolResult(
                text=f"Search failed: {type(exc).__name__}", error=True, latency_s=time.monotonic() - start
            )
        text = found if isinstance(found, str) else format_snippets(found, self.max_results, self.result_length)
        return ToolResult(text=text, latency_s=time.monotonic() - start, meta={"no_results": text == NO_RESULTS})


def load_documents(path: str | os.PathLike) -> list[dict]:
    """Read a corpus of documents (``.jsonl`` or ``.parquet``) with a ``text`` field and optional ``id``/``title``."""
    path = Path(path)
    if not path.exists():
        raise MissingDataError(f"search corpus not found: {path}", hint="pass corpus_path= a .jsonl or .parquet file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        docs = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            docs = [json.loads(line) for line in f if line.strip()]
    else:
        raise ConfigError(f"unsupported corpus format {path.suffix!r} for {path}; use .jsonl or .parquet")
    if docs and "text" not in docs[0]:
        raise ConfigError(f"corpus {path} has no 'text' field (fields: {sorted(docs[0])})")
    return docs


class BM25Backend:
    """Offline search: BM25 (``bm25s``) over a local corpus; a snippet is ``"{title}: {text}"``."""

    def __init__(
        self,
        corpus_path: str | os.PathLike | None = None,
        documents: list[dict] | None = None,
        index_dir: str | os.PathLike | None = None,
        top_k: int = 10,
    ) -> None:
        """Build (or load from ``index_dir``) the index.

        Args:
            corpus_path: A ``.jsonl``/``.parquet`` file of documents (fields ``text``, optional ``id``, ``title``).
            documents: The documents themselves (instead of ``corpus_path``).
            index_dir: If given, the index is loaded from here when present, else built and saved here.
            top_k: Documents retrieved per query.
        """
        import bm25s

        if (corpus_path is None) == (documents is None):
            raise ConfigError("BM25Backend needs exactly one of corpus_path= or documents=")
        if corpus_path is not None:
            docs = load_documents(corpus_path)
        else:
            assert documents is not None, "the check above lets exactly one of corpus_path and documents through"
            docs = list(documents)
        self._snippets = [self._snippet(d) for d in docs]
        self.top_k = top_k
        if index_dir is not None and (Path(index_dir) / "params.index.json").exists():
            self._index = bm25s.BM25.load(str(index_dir))
            if self._index.scores["num_docs"] != len(docs):
                raise ConfigError(
                    f"BM25 index in {index_dir} has {self._index.scores['num_docs']} documents, "
                    f"the corpus has {len(docs)}; delete the folder to rebuild it"
                )
        else:
            self._index = bm25s.BM25()
            tokens = bm25s.tokenize(self._snippets, stopwords="en", show_progress=False)
            self._index.index(tokens, show_progress=False)
            if index_dir is not None:
                self._index.save(str(index_dir), show_progress=False)

    @staticmethod
    def _snippet(doc: dict) -> str:
        text = re.sub(r"\s+", " ", str(doc["text"])).strip()
        title = str(doc.get("title") or "").strip()
        return f"{title}: {text}" if title else text

    def search(self, query: str) -> list[str]:
        """Return the snippets of the best-scoring documents (documents with score 0 are dropped)."""
        import bm25s

        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        k = min(self.top_k, len(self._snippets))
        ids, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [self._snippets[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]


class ReplayBackend:
    """Offline replay of a reference ``search_cache.json`` (cleaned query -> formatted text). Misses are errors."""

    def __init__(self, cache_json: str | os.PathLike) -> None:
        """Load the cache.

        Args:
            cache_json: Path of a JSON object mapping queries to formatted result text.
        """
        path = Path(cache_json)
        if not path.exists():
            raise MissingDataError(f"search cache not found: {path}", hint="run `arpo data pull` or fix the path")
        with path.open(encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} is not a JSON object mapping queries to results")
        self.entries = {clean_query(k): v for k, v in raw.items()}

    def search(self, query: str) -> str:
        """Look the query up as is, then with the ``"search query: "`` prefix added or removed."""
        query = clean_query(query)
        alternatives = (
            [query, query[len(QUERY_PREFIX) :].strip()]
            if query.startswith(QUERY_PREFIX)
            else [query, QUERY_PREFIX + query]
        )
        for key in alternatives:
            if key in self.entries:
                return self.entries[key]
        raise SearchError(f"Search failed: the query is not in the offline search cache: {query[:200]}")


class WebBackend:
    """Web search over HTTP for users with an API key (read from an environment variable, never logged).

    ``provider="brightdata"`` sends the reference request (POST ``{"zone", "url": <bing url>, "format": "raw"}``) and
    reads ``organic[*].description``; ``provider="json"`` POSTs ``{"query", "num"}`` and reads ``results[*].snippet``
    (or ``organic[*].description``), for self-hosted search services.
    """

    def __init__(
        self,
        url: str = "https://api.brightdata.com/request",
        api_key_env: str = "ARPO_SEARCH_API_KEY",
        provider: str = "brightdata",
        zone: str = "serp_api1",
        location: str = "us",
        timeout_s: float = 20.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        num: int = 10,
    ) -> None:
        """Configure the endpoint.

        Args:
            url: The search endpoint.
            api_key_env: Name of the environment variable holding the key (sent as a Bearer token).
            provider: ``"brightdata"`` (reference) or ``"json"``.
            zone: Bright Data zone (``brightdata`` only).
            location: Country code ``cc`` for Bing (reference default ``cn``).
            timeout_s: Timeout of each HTTP request.
            retries: Attempts in total for timeouts, connection errors, HTTP 429 and 5xx.
            backoff_s: First wait between attempts; doubled each time (with jitter).
            num: Results requested.
        """
        if provider not in ("brightdata", "json"):
            raise ConfigError(f"unknown web search provider {provider!r}; choose 'brightdata' or 'json'")
        if not os.environ.get(api_key_env):
            raise ConfigError(
                f"web search needs an API key in the environment variable {api_key_env}",
                hint=f"export {api_key_env}=... or use the 'bm25' or 'replay' search backend",
            )
        if retries < 1 or timeout_s <= 0:
            raise ConfigError("web search needs retries >= 1 and timeout_s > 0")
        self.url, self.api_key_env, self.provider, self.zone, self.location = url, api_key_env, provider, zone, location
        self.timeout_s, self.retries, self.backoff_s, self.num = timeout_s, retries, backoff_s, num

    def _payload(self, query: str) -> dict:
        if self.provider == "json":
            return {"query": query, "num": self.num}
        lang = "zh" if re.search(r"[\u4e00-\u9fff]", query) else "en"
        mkt = "zh-CN" if lang == "zh" else "en-US"
        bing = "https://www.bing.com/search?" + urllib.parse.urlencode(
            {"q": query, "mkt": mkt, "setLang": lang, "brd_json": 1, "cc": self.location}
        )
        return {"zone": self.zone, "url": bing, "format": "raw"}

    def search(self, query: str) -> list[str]:
        """POST the query, retrying with exponential backoff; raise ``SearchError`` (without the key) on failure."""
        problem = "unknown error"
        headers = {"Authorization": f"Bearer {os.environ.get(self.api_key_env, '')}"}
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + 0.1 * random.random()))
            try:
                data = request("POST", self.url, self._payload(query), headers=headers, timeout=self.timeout_s).data
                return self._snippets(data)
            except HTTPJSONError as exc:
                if exc.status is None:  # no answer: worth another try
                    problem = "timeout" if "timed out" in exc.reason else f"connection error ({exc.reason})"
                    continue
                if exc.reason.startswith("reply is not JSON"):
                    problem = "the response was not valid JSON"
                    break
                problem = f"HTTP {exc.status}"
                if exc.status != 429 and exc.status < 500:
                    break
            except ValueError:
                problem = "the response was not valid JSON"
                break
        raise SearchError(f"Search failed: {problem} after {attempt + 1} attempt(s).")

    @staticmethod
    def _snippets(data: dict) -> list[str]:
        if not isinstance(data, dict):
            raise ValueError("response is not a JSON object")
        items = data.get("results") or data.get("organic") or []
        return [str(it.get("snippet") or it.get("description") or "") for it in items if isinstance(it, dict)]


_SEARCH_TOOL_KEYS = ("max_results", "result_length", "max_query_chars")


def build_search(**settings: Any) -> SearchTool:
    """The ``tools.search`` section: ``backend`` (``bm25``, ``replay`` or ``web``), that backend's keyword arguments
    and the :class:`SearchTool` ones (``max_results``, ``result_length``, ``max_query_chars``), checked here."""
    backends: dict[str, Callable[..., Any]] = {"bm25": BM25Backend, "replay": ReplayBackend, "web": WebBackend}
    if "backend" not in settings:
        raise ConfigError("tools.search needs a 'backend' key: one of " + ", ".join(backends))
    name = settings.pop("backend")
    check_choice("backend", name, tuple(backends), "tools.search")
    backend_cls = backends[name]
    check_settings("tools.search", settings, backend_cls, _SEARCH_TOOL_KEYS)
    tool_kwargs = {k: settings.pop(k) for k in _SEARCH_TOOL_KEYS if k in settings}
    return SearchTool(backend_cls(**settings), **tool_kwargs)


def replay_defaults(env_config: Mapping[str, Any]) -> dict[str, Any]:
    """A task's default search: replay of the reference search cache (``search_cache.json`` of the data folder)."""
    from arpo_env.data import find_data_file

    return {"backend": "replay", "cache_json": str(find_data_file("search_cache.json", env_config.get("data_dir")))}
