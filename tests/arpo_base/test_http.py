"""The HTTP JSON client against a real local server: JSON both ways, headers, and every failure as one exception
naming the method, the URL and the status (or why no answer came)."""

from __future__ import annotations

import gzip
import json
import pickle
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from arpo_base.http import HTTPJSONError, bearer, download, get_json, post_json, request

PAYLOAD = b"a data file " * 1000


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, data: bytes, **headers: str) -> None:
        self.send_response(code)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/echo":
            got = {"auth": self.headers.get("Authorization"), "type": self.headers.get("Content-Type")}
            self._send(200, json.dumps(got).encode(), Content_Type="application/json")
        elif self.path == "/html":
            self._send(200, b"<html>not json</html>", Content_Type="text/html")
        elif self.path == "/gzip":
            self._send(200, gzip.compress(PAYLOAD), Content_Encoding="gzip")
        elif self.path == "/cut":  # promises more than it sends, then closes: the download fails mid-body
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAYLOAD) * 2))
            self.end_headers()
            self.wfile.write(PAYLOAD)
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        else:
            self._send(404, json.dumps({"error": {"message": "no such path"}}).encode(), Retry_After="2")

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(400, b"bad json")
            return
        self._send(200, json.dumps({"got": body, "method": self.command}).encode())


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_json_both_ways_with_headers(server):
    assert post_json(f"{server}/post", {"a": [1, 2]}) == {"got": {"a": [1, 2]}, "method": "POST"}
    assert get_json(f"{server}/echo", headers=bearer("k")) == {"auth": "Bearer k", "type": "application/json"}
    assert bearer(None) == {} and bearer("") == {}
    reply = request("POST", f"{server}/post", {"x": 1})
    assert reply.status == 200 and reply.data["got"] == {"x": 1} and "Content-Length" in reply.headers


def test_an_error_status_names_the_url_and_keeps_the_reply(server):
    with pytest.raises(HTTPJSONError) as info:
        get_json(f"{server}/missing")
    e = info.value
    assert e.status == 404 and e.url == f"{server}/missing" and e.data == {"error": {"message": "no such path"}}
    assert str(e).startswith(f"GET {server}/missing: HTTP 404 ") and "no such path" in str(e)
    assert e.headers.get("Retry-After") == "2" and isinstance(e, OSError)
    again = pickle.loads(pickle.dumps(e))
    assert (str(again), again.status, again.data) == (str(e), e.status, e.data)


def test_raw_bytes_are_sent_as_they_are(server):
    with pytest.raises(HTTPJSONError) as info:
        request("POST", f"{server}/post", raw=b"{not json")
    assert info.value.status == 400 and info.value.body == "bad json" and info.value.data is None


def test_a_reply_that_is_not_json(server):
    with pytest.raises(HTTPJSONError) as info:
        get_json(f"{server}/html")
    assert info.value.status == 200 and "not JSON" in info.value.reason and "<html>" in info.value.body


def test_no_answer_names_the_url_and_the_reason():
    with socket.socket() as s:  # a port nobody listens on: bound, then closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/models"
    with pytest.raises(HTTPJSONError) as info:
        get_json(url, timeout=5)
    assert info.value.status is None and str(info.value).startswith(f"GET {url}: no answer (")


def test_download_decodes_the_content_encoding_and_leaves_no_partial_file(server, tmp_path):
    """Bug: the body was copied from the raw stream, so a gzip-encoded file was saved still compressed, and a
    download cut mid-body left a partial file where the data belongs."""
    dest = tmp_path / "data.bin"
    download(f"{server}/gzip", str(dest))
    assert dest.read_bytes() == PAYLOAD
    cut = tmp_path / "cut.bin"
    with pytest.raises(HTTPJSONError):
        download(f"{server}/cut", str(cut))
    assert not cut.exists()
    with pytest.raises(HTTPJSONError, match="404"):  # a refused request leaves an earlier file as it was
        download(f"{server}/missing", str(dest))
    assert dest.read_bytes() == PAYLOAD
