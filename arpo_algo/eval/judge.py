"""LLM-as-judge through any OpenAI-compatible ``/v1/chat/completions`` endpoint, cached on disk.

The judge prompt lives in :data:`JUDGE_PROMPT` (the only place; the reference's wording,
docs/concepts/reference-choices.md#evaluation-protocol): one user
message with the question, the golden answer(s) and the predicted answer; the judge replies "Correct" or
"Incorrect". A reply counts as correct when it contains "correct" and none of "incorrect", "wrong", "not correct".

Decision rules (``--judge-rule``):

* ``reference`` (default; the reference evaluator's rule): string equivalence (our ``math_equiv`` or exact match of
  the extracted answer) OR the judge says correct.
* ``judge``: the judge's verdict alone.

Calls are cached in ``<cache_dir>/judge_cache.jsonl`` keyed by (judge model, prompt), so a rerun costs nothing.
A failing call is retried with exponential backoff (``retries`` times); then the run is marked ``unjudged``, scored by
string equivalence alone, counted in the report, and the evaluation continues.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from arpo_base.errors import ConfigError
from arpo_base.http import bearer, request

JUDGE_PROMPT = """Please determine if the predicted answer is equivalent to the labeled answer.
Question: {question}

Labeled Answer: {gold}

Predicted Answer: {pred}

Are these answers equivalent? The predicted answer is correct if it fully aligns with the meaning and key \
information of the labeled answer. Reply with exactly one word: "Correct" or "Incorrect"."""
JUDGE_RULES = ("reference", "judge")
NEGATIVE = ("incorrect", "wrong", "not correct")


def verdict(reply: str) -> bool:
    """The reference's reading of a judge reply."""
    text = reply.lower()
    return "correct" in text and not any(n in text for n in NEGATIVE)


class Judge:
    """An OpenAI-compatible judge with an on-disk cache.

    Args:
        url: Base URL (``http://host:port`` or ``.../v1``).
        model: Model name sent in requests (``--judge-model``; default: the server's first ``/v1/models`` entry).
        cache_dir: Folder of ``judge_cache.jsonl``.
        rule: "reference" or "judge" (see the module docstring).
        retries: Attempts after the first failure; backoff ``backoff_s * 2**attempt``.
        timeout_s: Per request.
        api_key: Sent as a Bearer token when given.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        cache_dir: Path,
        rule: str = "reference",
        retries: int = 3,
        backoff_s: float = 1.0,
        timeout_s: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        if rule not in JUDGE_RULES:
            raise ConfigError(f"--judge-rule must be one of {JUDGE_RULES}, got {rule!r}")
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.model, self.rule, self.retries, self.backoff_s, self.timeout_s = model, rule, retries, backoff_s, timeout_s
        self.api_key = api_key
        self.cache_path = Path(cache_dir) / "judge_cache.jsonl"
        self.cache: dict[str, str] = {}
        self.calls = self.cache_hits = self.failures = 0
        self._lock = threading.Lock()
        if self.cache_path.is_file():
            for line in self.cache_path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self.cache[row["key"]] = row["reply"]
                except (json.JSONDecodeError, KeyError):
                    continue

    def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        method = "GET" if body is None else "POST"
        return request(method, self.base + path, body, headers=bearer(self.api_key), timeout=self.timeout_s).data

    def _model(self) -> str:
        if self.model is None:
            models = self._post("/models", None).get("data") or []
            self.model = models[0]["id"] if models else "default"
        return self.model

    def ask(self, question: str, gold: Any, pred: str) -> str | None:
        """The judge's reply (cached), or None when every attempt failed."""
        golds = " OR ".join(gold) if isinstance(gold, (list, tuple)) else str(gold)
        prompt = JUDGE_PROMPT.format(question=question, gold=golds, pred=pred)
        for attempt in range(self.retries + 1):
            try:
                model = self._model()
                key = hashlib.sha256(json.dumps([model, prompt]).encode()).hexdigest()
                with self._lock:
                    if key in self.cache:
                        self.cache_hits += 1
                        return self.cache[key]
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "temperature": 0.0,
                    "max_tokens": 16,
                }
                reply = self._post("/chat/completions", body)["choices"][0]["message"]["content"] or ""
                with self._lock:
                    self.calls += 1
                    self.cache[key] = reply
                    with self.cache_path.open("a", encoding="utf-8") as f:
                        f.write(json.dumps({"key": key, "model": model, "reply": reply}) + "\n")
                return reply
            except (OSError, KeyError, IndexError, ValueError, TypeError):  # HTTPJSONError is an OSError
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
        with self._lock:
            self.failures += 1
        return None

    def score(self, record: dict[str, Any]) -> dict[str, Any]:
        """Add ``judge`` ("correct" / "incorrect" / "unjudged") and set ``correct`` by the decision rule."""
        string_equiv = bool(record["math_equiv"] or record["exact_match"])
        pred = record.get("answer")
        if pred is None:  # nothing to judge: no extracted answer is wrong under either rule
            record.update(judge="incorrect", correct=False)
            return record
        reply = self.ask(record["question"], record["ground_truth"], pred)
        if reply is None:
            record.update(judge="unjudged", correct=string_equiv)
            return record
        ok = verdict(reply)
        record["judge"] = "correct" if ok else "incorrect"
        record["correct"] = (string_equiv or ok) if self.rule == "reference" else ok
        return record

    def stats(self) -> dict[str, Any]:
        return {
            "judge_calls": self.calls,
            "judge_cache_hits": self.cache_hits,
            "judge_failures": self.failures,
            "judge_rule": self.rule,
            "judge_model": self.model,
        }
