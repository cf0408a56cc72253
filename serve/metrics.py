"""Prometheus metrics of the agent endpoint, through Ray's own metrics API (``ray.serve.metrics``).

Ray exports them with its other metrics (the ``/metrics`` endpoint of each node's metrics agent, port
``--metrics-export-port``), tagged with the deployment and replica automatically:

* ``arpo_serve_requests_total{model, status}``: finished requests by HTTP status (200, 400, 404, 499 = client gone,
  401/403/413/415 refused by the guard and 503 refused by the admission with ``model="-"``, 503 engine gone, 504
  deadline, 500 fault), each once; a request whose replica was lost mid-request is counted by Serve's proxy
  (:mod:`serve.proxy`), ``model="-"``, 503, without the deployment and replica tags.
* ``arpo_serve_tokens_total{model, kind}``: ``prompt`` and ``completion`` tokens (tool-result tokens count as
  completion tokens: they are part of the response).
* ``arpo_serve_tool_calls_total{model, tool, outcome}``: tool calls run by the server loop (``ok`` / ``error``) or
  handed to the client (``client``).
* ``arpo_serve_record_turns_total{model, outcome}``: turns of recorded episodes (``arpo serve --record``):
  ``continued`` (extending the episode's last turn token for token), ``new_segment``, ``refused`` (served, not
  recorded: the folder full, the episode rewarded), and ``unscoreable`` (recorded, a choice the learner cannot score).
* ``arpo_serve_request_latency_s{model}``: request latency (histogram, seconds; streams: until the last event).
"""

from __future__ import annotations

from typing import Any

from ray.serve import metrics

LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


class ServeMetrics:
    """The five metrics above; one instance per replica."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "arpo_serve_requests_total", description="finished chat requests", tag_keys=("model", "status")
        )
        self.tokens = metrics.Counter(
            "arpo_serve_tokens_total", description="prompt and completion tokens", tag_keys=("model", "kind")
        )
        self.tool_calls = metrics.Counter(
            "arpo_serve_tool_calls_total", description="tool calls", tag_keys=("model", "tool", "outcome")
        )
        self.record_turns = metrics.Counter(
            "arpo_serve_record_turns_total", description="turns of recorded episodes", tag_keys=("model", "outcome")
        )
        self.latency = metrics.Histogram(
            "arpo_serve_request_latency_s",
            description="request latency (s)",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=("model",),
        )

    def request(self, model: str, status: str, seconds: float) -> None:
        self.requests.inc(1, tags={"model": model, "status": status})
        self.latency.observe(seconds, tags={"model": model})

    def finished(self, model: str, result: dict[str, Any], seconds: float) -> None:
        usage = result["usage"]
        for kind in ("prompt", "completion"):
            if usage[f"{kind}_tokens"] > 0:  # Ray's counters refuse an increment of 0 (ValueError)
                self.tokens.inc(usage[f"{kind}_tokens"], tags={"model": model, "kind": kind})
        for choice in result["choices"]:
            msg = choice["message"]
            for call in msg.get("arpo", {}).get("tool_calls", []):
                outcome = "error" if call.get("error") else "ok"
                self.tool_calls.inc(1, tags={"model": model, "tool": str(call.get("tool")), "outcome": outcome})
            for call in msg.get("tool_calls") or []:
                self.tool_calls.inc(1, tags={"model": model, "tool": call["function"]["name"], "outcome": "client"})
        record = result["choices"][0]["message"].get("arpo", {}).get("record") if result["choices"] else None
        if record is not None:
            outcome = "refused" if not record["recorded"] else "continued" if record["continues"] else "new_segment"
            self.record_turns.inc(1, tags={"model": model, "outcome": outcome})
            if record.get("unscoreable"):
                self.record_turns.inc(1, tags={"model": model, "outcome": "unscoreable"})
        self.request(model, "200", seconds)  # last: a request is counted once, as 200 only when all of it went well
