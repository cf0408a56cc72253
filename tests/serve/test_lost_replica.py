"""A replica lost with a request in flight: real Ray Serve on 127.0.0.1, started as ``arpo serve`` starts it (the
proxy wrapped by :mod:`serve.proxy`), and a deployment whose process exits in the middle of a request.

The client gets the OpenAI-shaped 503 + Retry-After of a replica that cannot take a request (not the proxy's
plain-text 500); a server-sent-event stream cut off after its first event ends with the application's error event;
the application's own answers, its 500s included, pass through untouched.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.serve.guarded import counts_reaching, status_counts

pytest.importorskip("ray.serve")

START_TIMEOUT_S = 120
METRICS = {"port": 0}  # Ray's Prometheus export port (set by the url fixture)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str, timeout: float = 60) -> tuple[int, Any, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


@pytest.fixture(scope="module")
def url():
    import ray
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve

    from serve.proxy import controller_options

    api = FastAPI()

    @serve.deployment(name="doomed", health_check_period_s=1.0)
    @serve.ingress(api)
    class Doomed:
        @api.get("/ok")
        def ok(self) -> JSONResponse:
            return JSONResponse({"pid": os.getpid()})

        @api.get("/fail")
        def fail(self) -> JSONResponse:
            return JSONResponse({"error": {"message": "the application's own 500"}}, status_code=500)

        @api.get("/die")
        def die(self) -> None:
            os._exit(1)  # the replica's process is gone while it holds the request

        @api.get("/stream")
        def stream(self) -> StreamingResponse:
            async def events():
                yield 'data: {"first": true}\n\n'
                time.sleep(0.5)  # the event is on its way to the client before the process goes
                os._exit(1)

            return StreamingResponse(events(), media_type="text/event-stream")

    port, METRICS["port"] = _free_port(), _free_port()
    saved = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # export metrics every second (default 10 s)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS["port"])
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=controller_options())
        serve.run(Doomed.bind(), name="doomed", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_live(base)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = saved


def wait_live(base: str) -> int:
    """The pid of a live replica once one answers (the controller replaces a dead one)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            code, _, body = fetch(f"{base}/ok", timeout=10)
            if code == 200:
                return json.loads(body)["pid"]
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("no live replica")


def test_the_applications_own_answers_pass_through(url):
    assert fetch(f"{url}/ok")[0] == 200
    code, headers, body = fetch(f"{url}/fail")
    assert code == 500 and "Retry-After" not in headers
    assert json.loads(body) == {"error": {"message": "the application's own 500"}}


def test_a_request_in_flight_on_a_lost_replica_is_a_503_with_retry_after(url):
    before = wait_live(url)
    metrics = {"metrics_port": METRICS["port"]}
    prior = status_counts(metrics)  # what the module's other tests counted already, in whatever order they ran
    code, headers, body = fetch(f"{url}/die")
    assert code == 503, (code, body)  # Serve's proxy alone answers a plain-text 500 "Internal Server Error"
    assert headers["Retry-After"] == "1" and headers["Content-Type"] == "application/json", (headers, body)
    error = json.loads(body)["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_lost" and error["param"] is None
    assert wait_live(url) != before  # a new replica answers
    # counted as the admission's refusals are, once (the deployment here counts nothing: this count is the proxy's)
    after = counts_reaching(metrics, {"503": prior.get("503", 0.0) + 1})
    assert {k: v - prior.get(k, 0.0) for k, v in after.items() if v != prior.get(k, 0.0)} == {"503": 1}


def test_a_stream_cut_off_by_a_lost_replica_ends_with_an_error_event(url):
    wait_live(url)
    with urllib.request.urlopen(f"{url}/stream", timeout=60) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().split("\n\n") if line]  # reads to a clean end: no broken stream
    assert events[0] == 'data: {"first": true}'
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "replica_lost", events
    assert len(events) == 2
    wait_live(url)
