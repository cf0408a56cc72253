"""``arpo eval --endpoint URL``: evaluate an OpenAI-compatible server instead of a local model.

Each run drives the same evaluation environment (``arpo_env``: protocol, stop strings, result template, tool code,
limits, reward) as a local run; only the text comes from the server's ``POST /v1/chat/completions``:

* **Text with tool tags** (any chat server): the request carries the environment's stop strings; a reply that stopped
  on one gets its closing tag back (OpenAI servers drop the stop string) and goes to ``env.step``, which runs the tool
  and returns the exact result text. The conversation continues as one assistant message holding everything so far,
  sent with ``continue_final_message: true, add_generation_prompt: false`` (vLLM's and arpo serve's extension), so
  the model sees the same token layout as in training.
* **OpenAI ``tool_calls``**: each call runs through the environment's tool object of that name (same sandbox and
  cache) and its output goes back as a ``role: tool`` message; the call limit is the environment's.
* **Server-side tools** (``arpo serve``): when the reply message carries the agent's tool trace in an extension field
  (``arpo.tool_calls``: dicts with a ``tool`` key), the server ran the whole conversation; its ``arpo.trajectory``
  (else the content) is the response and is scored by the environment's reward.

Token budget: ``max_response_tokens`` counts every token after the prompt, tool results included, as the in-process
rollout does (:func:`arpo_algo.rollout.agent_loop.run_agents`). The reply's ``usage.completion_tokens`` are the
generated tokens; a tool result run here (text tags or ``tool_calls``) is counted with the served model's tokenizer
(``--tokenizer``) exactly as the rollout tokenizes it (:func:`arpo_algo.rollout.layout.observation_ids`), so the
same model gets the same budget through an endpoint as in process. Without a tokenizer such an endpoint is refused
(a ConfigError), never run on generated tokens alone. An agent that runs its tools server-side (``arpo serve``)
counts its tool results itself: its ``completion_tokens`` are its whole response, and its ``arpo.trained_mask``
tells the generated ones. An unreachable server is a clear error
(:func:`check_endpoint`) before any item runs. Seeds are sent per request:
``seed + 1000003 * item + 7919 * run + turn``.
"""

from __future__ import annotations

import json
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arpo_algo.eval.evaluation import EvalSettings
from arpo_algo.eval.runner import make_record, missing_runs
from arpo_algo.rollout.agent_loop import FINISH_REASONS, finish_reason, turn_from_env
from arpo_algo.rollout.metrics import is_correct
from arpo_base.errors import ArpoError, ConfigError
from arpo_base.http import HTTPJSONError, bearer, request

STANDARD_MESSAGE_KEYS = {
    "role",
    "content",
    "tool_calls",
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "reasoning_content",
    "reasoning",
}


def _base(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _request(url: str, body: dict[str, Any] | None, timeout: float, api_key: str | None = None) -> dict[str, Any]:
    method = "GET" if body is None else "POST"
    return request(method, url, body, headers=bearer(api_key), timeout=timeout).data


def served_models(url: str, *, timeout: float = 5.0, api_key: str | None = None) -> list[dict[str, Any]]:
    """The served models' entries (``GET /v1/models``); raises ArpoError when the server cannot be reached."""
    try:
        data = _request(_base(url) + "/models", None, timeout, api_key)
    except HTTPJSONError as e:
        raise ArpoError(
            f"endpoint {url} is unreachable ({e.reason})",
            hint="start the server first (e.g. `arpo serve MODEL`) and pass its base URL, like http://127.0.0.1:8000",
        ) from None
    return [m for m in data.get("data") or [] if isinstance(m, dict)]


def check_endpoint(url: str, *, timeout: float = 5.0, api_key: str | None = None) -> list[str]:
    """The served model names (``GET /v1/models``); raises ArpoError when the server cannot be reached."""
    return [m.get("id", "") for m in served_models(url, timeout=timeout, api_key=api_key)]


def runs_tools_itself(entries: list[dict[str, Any]], model: str) -> bool:
    """Whether ``model`` is an agent that runs its tools on the server (``arpo serve`` says so in ``/v1/models``)."""
    return any(m.get("id") == model and isinstance(m.get("arpo"), dict) for m in entries)


def _close_stop(text: str, stops: tuple[str, ...]) -> str:
    """Give a reply that stopped on a closing tag its tag back (the server removed it)."""
    for s in stops:
        opening = s.replace("</", "<", 1)
        if opening != s and text.rfind(opening) > text.rfind(s):
            return text + s
    return text


def _server_trace(message: dict[str, Any]) -> list[dict[str, Any]] | None:
    for key, value in message.items():
        if key in STANDARD_MESSAGE_KEYS:
            continue
        if isinstance(value, dict):
            value = value.get("tool_calls")
        if isinstance(value, list) and all(isinstance(v, dict) and "tool" in v for v in value):
            return value
    return None


class EndpointAgent:
    """Runs one conversation of an environment against an OpenAI-compatible server (see the module docstring)."""

    def __init__(
        self,
        url: str,
        model: str,
        settings: EvalSettings,
        *,
        timeout_s: float = 300.0,
        api_key: str | None = None,
        server_tools: bool = False,
        tokenizer: Any = None,
    ) -> None:
        self.url, self.model, self.settings = _base(url) + "/chat/completions", model, settings
        self.timeout_s, self.api_key = timeout_s, api_key
        #: The server runs the tools (``arpo serve``): the environment's tool-call tags are not sent as stop
        #: strings, which would end every answer at its first call before the server ran the tool.
        self.server_tools = server_tools
        #: The served model's tokenizer: tool results run here count against the response budget with it.
        self.tokenizer = tokenizer
        if tokenizer is None and not server_tools:
            raise ConfigError(
                f"evaluating {model!r} through {url} runs its tools here, and their results count against "
                f"--max-response-tokens ({settings.max_response_tokens}) as in a local run: that needs the served "
                "model's tokenizer",
                hint="pass --tokenizer with the served model's folder or registered name",
            )

    def _result_tokens(self, text: str) -> int:
        """Tokens a tool result adds to the response, as the rollout appends it (tokenized on its own)."""
        from arpo_algo.rollout import layout

        return len(layout.observation_ids(self.tokenizer, text)) if self.tokenizer is not None else 0

    def _completion_tokens(self, reply: dict[str, Any], text: str, sampled: str, ended_by_eos: bool) -> int:
        """The reply's generated tokens: the server's ``usage``, else counted with the tokenizer: ``sampled`` (the
        text with the stop string the server removed given back) and the EOS that ended it, if one did.

        Invariant: every reply is counted against the budget; a server that reports no usage is never treated as
        having generated nothing (the loop would then run to its turn cap)."""
        usage = reply.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            return int(usage["completion_tokens"])
        if self.tokenizer is not None:
            return len(self.tokenizer(sampled, add_special_tokens=False)["input_ids"]) + int(ended_by_eos)
        raise ArpoError(
            f"{self.url} reported no usage.completion_tokens, so the response budget cannot be counted",
            hint="pass --tokenizer with the served model's folder: the replies are then counted with it",
        )

    def _call(
        self, messages: list[dict[str, Any]], stops: tuple[str, ...], max_tokens: int, seed: int, cont: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "max_tokens": max_tokens,
            "seed": seed,
        }
        if stops and not self.server_tools:
            body["stop"] = list(stops)
        if cont:
            body.update(continue_final_message=True, add_generation_prompt=False)
        try:
            return _request(self.url, body, self.timeout_s, self.api_key)
        except HTTPJSONError as e:
            if e.status is not None and not 200 <= e.status < 300:
                raise ArpoError(f"endpoint answered HTTP {e.status}: {e.body[:300]}") from None
            raise ArpoError(f"endpoint request failed ({e.reason})") from None

    def run(self, env: Any, index: int, run: int) -> dict[str, Any]:
        """One run of task ``index``; returns make_record's keyword arguments."""
        s = self.settings
        _, info = env.reset(options={"task_index": index})
        base_messages = list(info["messages"])
        stops = tuple(env.stop_sequences)
        response, tool_msgs, calls = "", [], []
        # Invariant (the rollout's budget): ``tokens`` counts every token after the prompt, generated and tool
        # results alike, and no request may take it past max_response_tokens; ``generated`` counts the sampled ones.
        tokens, generated, finish, reward, reward_info, done = 0, 0, "length", 0.0, {}, False
        turn, server_side = 0, False
        end: str | None = None  # why a run the environment did not end stopped, in the rollout's labels
        eos_end = False  # an EOS ended the run as the rollout ends it: the label is "eos" whatever the text holds
        while not done and tokens < s.max_response_tokens and turn < 64:
            seed = s.seed + 1000003 * index + 7919 * run + turn
            cont = bool(response) and not tool_msgs
            messages = base_messages + ([{"role": "assistant", "content": response}] if cont else []) + tool_msgs
            reply = self._call(messages, stops, s.max_response_tokens - tokens, seed, cont)
            turn += 1
            choice = reply["choices"][0]
            msg = choice.get("message") or {}
            text = msg.get("content") or ""
            stopped = choice.get("finish_reason") == "stop"
            # OpenAI's "stop" covers the EOS and a stop string; vLLM's stop_reason tells them apart (the matched
            # string, or None / a token id for an EOS). Without it a reply that stopped inside an open tool tag is
            # taken to have stopped on its closing tag.
            by_eos = stopped and "stop_reason" in choice and not isinstance(choice["stop_reason"], str)
            action = _close_stop(text, stops) if stopped and not by_eos else text
            completion = self._completion_tokens(
                reply, text, action, by_eos or (stopped and action == text and not msg.get("tool_calls"))
            )
            tokens += completion
            generated += completion
            trace = _server_trace(msg)
            if trace is not None:  # arpo serve ran the tools itself: its trajectory is the whole response
                ext = msg.get("arpo") if isinstance(msg.get("arpo"), dict) else {}
                response += ext.get("trajectory") or text
                mask = ext.get("trained_mask")
                if isinstance(mask, list):  # its completion tokens include the tool results it appended
                    generated += sum(1 for m in mask if m) - completion
                server_side = True
                # the server's agent ran the rollout's own loop: its label is the run's
                end = (
                    ext.get("finish_reason")
                    if ext.get("finish_reason") in FINISH_REASONS
                    else ("length" if tokens >= s.max_response_tokens else "eos")
                )
                calls += [
                    {
                        "tool": c.get("tool"),
                        "args": c.get("args") or c.get("arguments"),
                        "output": c.get("output") or c.get("result"),
                        "error": c.get("error", False),
                    }
                    for c in trace
                ]
                break
            if msg.get("tool_calls"):
                response += text
                tool_msgs += [{"role": "assistant", "content": text, "tool_calls": msg["tool_calls"]}]
                for call in msg["tool_calls"]:
                    out = self._run_tool(env, call, calls)
                    tool_msgs.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": out})
                    tokens += self._result_tokens(out)
                continue
            if tool_msgs:  # an OpenAI tool-call conversation ends with a plain message
                response += text
                end = "length" if choice.get("finish_reason") == "length" else "eos"
                break
            obs, reward, term, trunc, step_info = env.step(action)
            if step_info.get("tool_calls", 0) > len(calls):
                calls.append(
                    {
                        "tool": step_info["tool"],
                        "args": step_info.get("args"),
                        "output": step_info.get("tool_output"),
                        "error": step_info.get("tool_error", False),
                        "latency_s": step_info.get("latency_s", 0.0),
                        "cache_hit": step_info.get("cache_hit", False),
                    }
                )
            if by_eos and not (term or trunc):  # as the rollout: a turn the EOS closed ends the run, no result added
                response += action
                end, eos_end = "eos", True
                break
            response += action + obs
            tokens += self._result_tokens(obs)
            if term or trunc:
                done, reward_info = True, step_info.get("reward_info", {})
                if step_info.get("append_eos") and tokens < s.max_response_tokens:
                    # the EOS the rollout appends (and trains) at the tool-call limit is a response token there
                    tokens, generated = tokens + 1, generated + 1
                # the rollout's own labels, so a run cut by the budget reads "length" here as in process
                last = types.SimpleNamespace(engine_error=None, last_finish=choice.get("finish_reason") or "eos")
                finish = finish_reason(turn_from_env((obs, reward, term, trunc, step_info), len(calls)), last)
        if not done:  # scored as a whole by the environment's reward (server-side tools, tool_calls, budget)
            task = env.tasks[index]
            kwargs = {**(task.get("reward_kwargs") or {}), **env.config["reward_kwargs"]}
            reward, breakdown = env.reward_fn(response, task["ground_truth"], **kwargs)
            reward_info = {"reward_name": env.config["reward"], "score": float(reward), **breakdown}
            if (server_side or eos_end) and end is not None:
                finish = end
            elif "</answer>" in response:
                finish = "answer"
            else:
                finish = end or ("length" if tokens >= s.max_response_tokens else "turn_limit")
        return {
            "text": response,
            "reward": float(reward),
            "reward_info": reward_info,
            "correct": is_correct(types.SimpleNamespace(reward_info=reward_info)),
            "finish_reason": finish,
            "tool_calls": calls,
            "generated_tokens": generated,
            # a result that crosses the budget ends the run there, as the rollout truncates its response
            "response_tokens": min(tokens, s.max_response_tokens),
            "server_side_tools": server_side,
        }

    def _run_tool(self, env: Any, call: dict[str, Any], calls: list[dict[str, Any]]) -> str:
        fn = call.get("function") or {}
        name = fn.get("name", "")
        if len(calls) >= env.config["max_tool_calls"]:
            return f"Error: the tool call limit ({env.config['max_tool_calls']}) is reached; give the final answer."
        if name not in env.tools:
            return f"Error: unknown tool {name!r}; available: {', '.join(env.tools)}"
        try:
            args = json.loads(fn.get("arguments") or "{}")
            result = env.tools[name](**args)
            text, error = result.text, result.error
        except Exception as e:  # noqa: BLE001  (bad arguments from the model are reported to it, never raised)
            text, error, args = f"Error: {e}", True, fn.get("arguments")
        calls.append({"tool": name, "args": args, "output": text, "error": error})
        return text


def run_endpoint(
    agent: EndpointAgent,
    env_creator: Callable[[], Any],
    items: list[dict[str, Any]],
    *,
    model: str,
    out_file: Path,
    skip: set[str],
    recorded: dict[str, set[int]] | None = None,
    score: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    on_item: Callable[[list[dict[str, Any]]], None] | None = None,
) -> int:
    """K runs of every item not in ``skip`` through the server (less the runs ``recorded`` per item id); appends
    records per item; returns items run."""
    todo = [i for i, it in enumerate(items) if it["id"] not in skip]
    env = env_creator() if todo else None
    for idx in todo:
        t0 = time.perf_counter()
        runs = missing_runs(recorded, items[idx]["id"], agent.settings.samples)
        results = [agent.run(env, idx, r) for r in runs]
        wall = time.perf_counter() - t0
        records = [make_record(model, items[idx], idx, r, wall_s=wall, **res) for r, res in zip(runs, results)]
        records = [score(rec) if score else rec for rec in records]
        with out_file.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, default=str) + "\n" for r in records))
        if on_item:
            on_item(records)
    return len(todo)
