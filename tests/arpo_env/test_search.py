"""Search tool: BM25 on a corpus built here, replay of the real reference cache, web backend on a local server."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from arpo_base.errors import ConfigError
from arpo_env.tools import build_tools
from arpo_env.tools.search import (
    NO_RESULTS,
    BM25Backend,
    ReplayBackend,
    SearchTool,
    WebBackend,
    format_snippets,
)

DOCS = [
    {"id": "1", "title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."},
    {"id": "2", "title": "Colosseum", "text": "The Colosseum is an ancient amphitheatre in the centre of Rome."},
    {"id": "3", "title": "Great Wall", "text": "The Great Wall of China is a series of fortifications in China."},
    {"id": "4", "title": "Paris", "text": "Paris is the capital and most populous city of France."},
]


def test_format_snippets_matches_reference():
    snippets = ["  a  ", "", "b", "a", "c" * 1500] + [f"s{i}" for i in range(20)]
    text = format_snippets(snippets, max_results=10, result_length=1000)
    lines = text.split("\n")
    assert lines[:3] == ["Page 1: a", "Page 2: b", "Page 3: " + "c" * 1000] and len(lines) == 10
    assert format_snippets(["", "  "]) == NO_RESULTS


def test_bm25_from_documents_and_jsonl(tmp_path):
    tool = SearchTool(BM25Backend(documents=DOCS))
    result = tool(query="tower in Paris")
    assert not result.error and result.text.startswith("Page 1: Eiffel Tower: The Eiffel Tower")
    assert "Page 2: Paris:" in result.text and "Colosseum" not in result.text
    assert tool(query="quantum chromodynamics").text == NO_RESULTS
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(d) for d in DOCS))
    index_dir = tmp_path / "index"
    built = SearchTool(BM25Backend(corpus_path=corpus, index_dir=index_dir))
    loaded = SearchTool(BM25Backend(corpus_path=corpus, index_dir=index_dir))  # loads the persisted index
    assert (index_dir / "params.index.json").exists()
    assert built(query="Rome amphitheatre").text == loaded(query="Rome amphitheatre").text
    assert loaded(query="Rome amphitheatre").text.startswith("Page 1: Colosseum")


def test_bm25_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.Table.from_pylist(DOCS), path)
    assert SearchTool(BM25Backend(corpus_path=path))(query="Great Wall China").text.startswith("Page 1: Great Wall")


@pytest.mark.parametrize("bad", ["", '""', 7, None, "q" * 5000])
def test_bad_queries_never_raise(bad):
    result = SearchTool(BM25Backend(documents=DOCS))(query=bad)
    assert result.error and "Invalid argument" in result.text


def test_replay_real_cache(shared_data):
    path = shared_data / "search_cache.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    tool = SearchTool(ReplayBackend(path))
    plain = next(k for k in raw if not k.startswith("search query: "))
    prefixed = next(k for k in raw if k.startswith("search query: "))
    assert tool(query=plain).text == raw[plain]
    assert tool(query=f' "{plain}" ').text == raw[plain]  # reference cleaning: strip, drop quotes
    assert tool(query=prefixed[len("search query: ") :]).text == raw[prefixed]  # prefix added on lookup
    miss = tool(query="a query nobody ever searched for 12345")
    assert miss.error and "not in the offline search cache" in miss.text
    hits = sum(not tool(query=k).error for k in list(raw)[:200])
    assert hits == 200


class _Handler(BaseHTTPRequestHandler):
    calls: list[dict] = []
    plan: list[str] = []

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append({"body": body, "auth": self.headers["Authorization"]})
        action = type(self).plan.pop(0) if type(self).plan else "ok"
        if action == "500":
            self.send_response(500)
            self.end_headers()
            return
        if action == "slow":
            time.sleep(1.5)
        payload = {
            "organic": [
                {"description": "first result"},
                {"description": ""},
                {"description": "second"},
                {"description": "first result"},
            ]
        }
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a "slow" answer arrives after the client's timeout: the client has closed, as the test intends

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    _Handler.calls, _Handler.plan = [], []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/request"
    httpd.shutdown()
    httpd.server_close()


def test_web_backend_success_and_key_handling(server, monkeypatch):
    monkeypatch.setenv("ARPO_TEST_SEARCH_KEY", "sk-secret-123")
    tool = SearchTool(WebBackend(url=server, api_key_env="ARPO_TEST_SEARCH_KEY", timeout_s=1.0, backoff_s=0.05))
    result = tool(query='who "built" the Eiffel tower')
    assert result.text == "Page 1: first result\nPage 2: second"
    call = _Handler.calls[0]
    assert call["auth"] == "Bearer sk-secret-123" and call["body"]["format"] == "raw"
    assert "built" in call["body"]["url"] and "%22" not in call["body"]["url"]


def test_web_backend_retries_then_succeeds(server, monkeypatch):
    monkeypatch.setenv("ARPO_TEST_SEARCH_KEY", "sk-secret-123")
    _Handler.plan = ["500", "500"]
    tool = SearchTool(
        WebBackend(
            url=server, api_key_env="ARPO_TEST_SEARCH_KEY", provider="json", retries=3, timeout_s=1.0, backoff_s=0.05
        )
    )
    result = tool(query="anything")
    assert (
        not result.error and len(_Handler.calls) == 3 and _Handler.calls[0]["body"] == {"query": "anything", "num": 10}
    )


def test_web_backend_timeout_and_failure_hide_key(server, monkeypatch):
    monkeypatch.setenv("ARPO_TEST_SEARCH_KEY", "sk-secret-123")
    _Handler.plan = ["slow", "slow"]
    tool = SearchTool(
        WebBackend(url=server, api_key_env="ARPO_TEST_SEARCH_KEY", retries=2, timeout_s=0.3, backoff_s=0.05)
    )
    result = tool(query="slow query")
    assert result.error and "timeout after 2 attempt(s)" in result.text and "sk-secret" not in result.text
    _Handler.plan = ["500"] * 3
    failed = tool(query="broken")
    assert failed.error and "HTTP 500" in failed.text and "sk-secret" not in failed.text


def test_web_backend_needs_key(monkeypatch):
    monkeypatch.delenv("ARPO_TEST_SEARCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="ARPO_TEST_SEARCH_KEY"):
        WebBackend(api_key_env="ARPO_TEST_SEARCH_KEY")


def test_build_tools_search_strict(tmp_path):
    tools = build_tools({"search": {"backend": "bm25", "documents": DOCS, "max_results": 1}})
    assert tools["search"](query="Paris").text.count("Page ") == 1
    assert tools["search"].schema()["function"]["parameters"]["required"] == ["query"]
    with pytest.raises(ConfigError, match="tools.search: unknown key 'corpus'") as err:
        build_tools({"search": {"backend": "bm25", "corpus": "x"}})
    assert err.value.hint == "did you mean 'corpus_path'?"
    with pytest.raises(ConfigError, match="backend='google' is not one of 'bm25'"):
        build_tools({"search": {"backend": "google"}})
    with pytest.raises(ConfigError, match="tools: unknown key 'serch'") as err:
        build_tools({"serch": {}})
    assert err.value.hint == "did you mean 'search'?"
