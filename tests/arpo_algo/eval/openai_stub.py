"""A small OpenAI-compatible HTTP server on 127.0.0.1 for tests: a fake remote model or judge, not a mock of arpo.

``StubServer(reply)`` serves ``GET /v1/models`` and ``POST /v1/chat/completions``; ``reply(body)`` returns the
assistant message dict (and optionally ``finish_reason`` / ``stop_reason`` / ``usage``) for a request body. Requests
are recorded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StubServer:
    def __init__(
        self,
        reply: Callable[[dict[str, Any]], dict[str, Any]],
        model: str = "stub-model",
        model_extra: dict[str, Any] | None = None,
    ) -> None:
        self.reply, self.model, self.requests = reply, model, []
        self.model_extra = dict(model_extra or {})  # extra fields of the model's /v1/models entry
        self.fail_next = 0  # answer this many chat requests with HTTP 503
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/") == "/v1/models":
                    self._send(
                        200, {"object": "list", "data": [{"id": stub.model, "object": "model", **stub.model_extra}]}
                    )
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                if stub.fail_next > 0:
                    stub.fail_next -= 1
                    self._send(503, {"error": {"message": "overloaded"}})
                    return
                out = dict(stub.reply(body))
                finish = out.pop("finish_reason", "stop")
                usage = out.pop("usage", {"completion_tokens": len((out.get("content") or "").split())})
                # vLLM's extra field: which stop ended the reply (None: the EOS token); absent unless given
                extra = {"stop_reason": out.pop("stop_reason")} if "stop_reason" in out else {}
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "model": stub.model,
                        "usage": usage,
                        "choices": [
                            {"index": 0, "finish_reason": finish, **extra, "message": {"role": "assistant", **out}}
                        ],
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> StubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def closed_port_url() -> str:
    """A 127.0.0.1 URL where nothing listens."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"
