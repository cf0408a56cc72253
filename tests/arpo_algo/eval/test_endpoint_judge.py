"""``arpo eval --endpoint`` and ``--judge`` against small OpenAI-compatible servers on 127.0.0.1 (fake remote models
that only answer right when the real python tool ran), plus the unreachable cases."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from arpo_algo.cli.main import main
from tests.arpo_algo.eval.openai_stub import StubServer, closed_port_url

# The python tool's per-call sandbox uids come from a per-process pool starting at 62000; another process on the same
# host drawing the same uid can have its sandbox killed by ours. A private uid range keeps these tests independent of
# whatever else runs on the host.
PRIVATE_TOOLS = ["--env-set", f"tools={{python={{uid_base={100_000 + (os.getpid() % 5000) * 64}}}}}"]


def _write_items(tmp_path: Path) -> Path:
    path = tmp_path / "mult.jsonl"
    rows = [
        {"id": "six-seven", "question": "What is 6 times 7?", "answer": "42", "data_source": "mult"},
        {"id": "five-nine", "question": "What is 5 times 9?", "answer": "46", "data_source": "mult"},  # wrong gold
        {"id": "no-gold", "question": "What is 2 times 2?", "answer": ""},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _numbers(body) -> list[int]:
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    return [int(x) for x in re.findall(r"\d+", user)]


def text_agent(body):
    """Writes a python call (the server drops the stop string), then answers with the number in the tool result."""
    last = body["messages"][-1]
    if last["role"] == "assistant":
        assert body.get("continue_final_message") is True and body.get("add_generation_prompt") is False
        found = re.search(r"<result>\s*(-?\d+)\s*</result>", last["content"])
        if not found:
            return {"content": "<answer>\\boxed{none}</answer>"}
        return {"content": f"<think>done</think>\n<answer>\\boxed{{{found.group(1)}}}</answer>"}
    a, b = _numbers(body)[:2]
    assert "</python>" in body["stop"]
    return {"content": f"<think>multiply</think>\n<python>print({a}*{b})", "finish_reason": "stop"}


def tool_calls_agent(body):
    """OpenAI-style tool calls; answers with the tool message's content."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {"content": f"<answer>\\boxed{{{last['content'].strip()}}}</answer>"}
    a, b = _numbers(body)[:2]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "python", "arguments": json.dumps({"code": f"print({a}*{b})"})},
    }
    return {"content": "", "tool_calls": [call], "finish_reason": "tool_calls"}


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("agent", [text_agent, tool_calls_agent], ids=["text_tags", "openai_tool_calls"])
def test_endpoint_runs_tools_client_side(tiny_model_dir, tmp_path, agent, capsys):
    data = _write_items(tmp_path)
    out = tmp_path / "out"
    with StubServer(agent) as server:
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--data",
                str(data),
                "--env",
                "arpo/ToolMath-v0",
                "--k",
                "2",
                "--output",
                str(out),
                "--no-progress",
                "--no-charts",
                *PRIVATE_TOOLS,
            ]
        )
    assert rc == 0, capsys.readouterr().err
    s = _summary(out)
    assert s["skipped_no_ground_truth"] == 1 and s["items"] == 2
    assert s["columns"]["question"] == "question" and s["columns"]["answer"] == "answer"
    stats = s["models"]["stub-model@endpoint"]["all"]
    assert stats["pass@1"] == 0.5 and stats["pass@2"] == 0.5  # 6*7 right; 5*9 = 45 is scored against gold 46
    assert stats["tool_calls_per_run"] == 1.0
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["answer"] for r in rows} == {"42", "45"}
    assert all(r["tool_calls"][0]["tool"] == "python" and not r["tool_calls"][0]["error"] for r in rows)
    if agent is text_agent:
        assert "<python>print(6*7)</python> <result>\n42\n</result>" in rows[0]["response"]  # training's layout
    seeds = [b["seed"] for b in server.requests]
    assert len(set(seeds)) > 1


def server_tools_agent(body):
    """Like ``arpo serve``: the agent runs its python call on the server and returns the whole trajectory with the
    call trace; a client stop string ends it where the stop appears, as the server's session does."""
    a, b = _numbers(body)[:2]
    trajectory = f"<python>print({a}*{b})</python> <result>\n{a * b}\n</result> <answer>\\boxed{{{a * b}}}</answer>"
    for stop in body.get("stop") or []:
        if stop in trajectory:  # the session ends the conversation at the client's stop: no tool ran
            return {"content": trajectory[: trajectory.index(stop)], "arpo": {"tool_calls": [], "trajectory": ""}}
    call = {"tool": "python", "args": {"code": f"print({a}*{b})"}, "output": f"{a * b}\n", "error": False}
    return {"content": f"\\boxed{{{a * b}}}", "arpo": {"tool_calls": [call], "trajectory": trajectory}}


def test_an_agent_that_runs_its_tools_gets_no_tool_stop_strings(tmp_path, capsys):
    """Bug: the client sent the environment's tool tags (``</python>``) as stop strings to ``arpo serve`` too, whose
    session then ended every tool-using answer at its first call, before the tool ran: pass@1 near 0, no error. An
    endpoint whose /v1/models entry says it runs the tools (``arpo``) is now sent none."""
    data = _write_items(tmp_path)
    out = tmp_path / "out"
    with StubServer(server_tools_agent, model_extra={"arpo": {"engine": "hf", "tools": ["python"]}}) as server:
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--data",
                str(data),
                "--env",
                "arpo/ToolMath-v0",
                "--k",
                "1",
                "--output",
                str(out),
                "--no-progress",
                "--no-charts",
                *PRIVATE_TOOLS,
            ]
        )
    assert rc == 0, capsys.readouterr().err
    assert server.requests and not any("stop" in b for b in server.requests)
    stats = _summary(out)["models"]["stub-model@endpoint"]["all"]
    assert stats["tool_calls_per_run"] == 1.0 and stats["pass@1"] == 0.5  # 6*7 right; 5*9 against gold 46


def tool_limit_server_agent(body):
    """Like ``arpo serve`` at its tool-call limit: one call ran, no answer, the session's own label."""
    call = {"tool": "python", "args": {"code": "print(1)"}, "output": "1\n", "error": False}
    return {
        "content": "",
        "arpo": {
            "tool_calls": [call],
            "finish_reason": "tool_limit",
            "trajectory": "<python>print(1)</python> <result>\n1\n</result>",
        },
    }


def unanswered_tool_calls_agent(body):
    """An OpenAI tool-call conversation that ends with a plain message and no answer."""
    if body["messages"][-1]["role"] == "tool":
        return {"content": "I cannot tell.", "finish_reason": "stop"}
    return tool_calls_agent(body)


@pytest.mark.parametrize(
    ("agent", "extra", "finish"),
    [
        (tool_limit_server_agent, {"arpo": {"engine": "hf", "tools": ["python"]}}, "tool_limit"),
        (unanswered_tool_calls_agent, {}, "eos"),
    ],
    ids=["served_agent", "openai_tool_calls"],
)
def test_a_run_not_cut_by_the_budget_is_not_recorded_as_length(tiny_model_dir, tmp_path, capsys, agent, extra, finish):
    """Bug: a run the environment did not end was recorded as "length" whatever stopped it, so the summary's finish
    reasons could not tell a budget cut from a served agent's own end or a plain closing message."""
    out = tmp_path / "out"
    with StubServer(agent, model_extra=extra) as server:
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--data",
                str(_write_items(tmp_path)),
                "--env",
                "arpo/ToolMath-v0",
                "--k",
                "1",
                "--output",
                str(out),
                "--no-progress",
                "--no-charts",
                *PRIVATE_TOOLS,
            ]
        )
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and {r["finish_reason"] for r in rows} == {finish}


def test_endpoint_unreachable_is_a_clear_error_before_the_run(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "eval",
            "--endpoint",
            closed_port_url(),
            "--data",
            str(_write_items(tmp_path)),
            "--env",
            "arpo/ToolMath-v0",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "unreachable" in err and "hint:" in err and "Traceback" not in err
    assert not (out / "samples.jsonl").exists()


def test_endpoint_error_status_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    """A server that answers a chat request with an error status stops the run with its status and reply text."""
    with StubServer(text_agent) as server:
        server.fail_next = 10**6
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--data",
                str(_write_items(tmp_path)),
                "--env",
                "arpo/ToolMath-v0",
                "--output",
                str(tmp_path / "out"),
                "--no-progress",
                "--no-charts",
                *PRIVATE_TOOLS,
            ]
        )
    err = capsys.readouterr().err
    assert rc == 2 and "endpoint answered HTTP 503: " in err and "overloaded" in err and "Traceback" not in err


def judge_server(body):
    prompt = body["messages"][0]["content"]
    pred = prompt.split("Predicted Answer: ")[1].split("\n")[0].strip()
    return {"content": "Correct" if pred == "45" else "Incorrect"}


def test_judge_rules_cache_and_unjudged(tiny_model_dir, tmp_path, capsys):
    """The judge accepts 45 for the item whose gold is 46: the reference rule (string OR judge) then counts both items
    correct; a rerun in a new folder with the same cache dir costs no judge call; a dead judge leaves runs unjudged."""
    data = _write_items(tmp_path)
    with StubServer(text_agent) as model, StubServer(judge_server, model="judge") as judge:
        out = tmp_path / "judged"
        args = [
            "eval",
            "--endpoint",
            model.url,
            "--tokenizer",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--env",
            "arpo/ToolMath-v0",
            "--k",
            "1",
            "--no-progress",
            "--no-charts",
            "--judge",
            judge.url,
            *PRIVATE_TOOLS,
        ]
        assert main([*args, "--output", str(out)]) == 0, capsys.readouterr().err
        s = _summary(out)
        assert s["models"]["stub-model@endpoint"]["all"]["pass@1"] == 1.0
        assert s["judge"]["judge_calls"] == 2 and s["judge"]["judge_rule"] == "reference"
        calls_before = len(judge.requests)
        (out / "samples.jsonl").unlink()  # rerun everything: the judge answers come from the on-disk cache
        assert main([*args, "--output", str(out)]) == 0
        assert len(judge.requests) == calls_before and _summary(out)["judge"]["judge_cache_hits"] == 2

        strict = tmp_path / "strict"
        assert main([*args, "--output", str(strict), "--judge-rule", "judge"]) == 0
        rows = [json.loads(x) for x in (strict / "samples.jsonl").read_text().splitlines()]
        assert {r["item_id"]: r["judge"] for r in rows} == {"six-seven": "incorrect", "five-nine": "correct"}
        assert _summary(strict)["models"]["stub-model@endpoint"]["all"]["pass@1"] == 0.5

        judge.fail_next = 10**6  # the judge keeps failing: retries with backoff, then unjudged; the run goes on
        flaky = tmp_path / "flaky"
        assert main([*args, "--output", str(flaky), "--judge-retries", "1"]) == 0
        s = _summary(flaky)["models"]["stub-model@endpoint"]["all"]
        assert s["unjudged"] == 2 and s["pass@1"] == 0.5  # string equivalence alone


@pytest.fixture(scope="module")
def arpo_serve(tmp_path_factory):
    """A real ``arpo serve`` application (Ray Serve on 127.0.0.1) over a tiny untrained model with the python tool."""
    pytest.importorskip("ray.serve")
    import socket

    import ray
    from ray import serve

    from arpo_algo.models import build_tiny_model
    from serve.agents import build_specs
    from serve.app import build_app
    from serve.cli.serve import wait_ready
    from serve.guard import Security

    model = build_tiny_model(tmp_path_factory.mktemp("served") / "tiny", num_layers=2, hidden_size=64, seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if ray.is_initialized():  # left by a test that failed elsewhere: one failure must not cascade
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(
            build_app(
                build_specs([f"tiny={model}"], tools="python", max_tool_calls=3, max_tokens=64),
                Security(allow_unauthenticated=True, port=port),
            ),
            name="arpo-eval-test",
            route_prefix="/",
            blocking=False,
        )
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 300)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def test_endpoint_against_arpo_serve(arpo_serve, tmp_path, capsys):
    """Tools run server-side: the client scores the served trajectory with the environment's reward."""
    out = tmp_path / "served"
    rc = main(
        [
            "eval",
            "--endpoint",
            arpo_serve,
            "--data",
            "toolmath",
            "--limit",
            "2",
            "--k",
            "2",
            "--max-response-tokens",
            "24",
            "--output",
            str(out),
            "--no-progress",
            "--no-charts",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["model"] for r in rows} == {"tiny@endpoint"}
    assert all(r["server_side_tools"] and 0 < r["generated_tokens"] <= 24 and r["response"] for r in rows)
    s = _summary(out)["models"]["tiny@endpoint"]["all"]
    assert s["items"] == 2 and s["k"] == 2 and s["pass@1"] == 0.0  # an untrained model answers nothing right


def scripted_server(engine, eos_reason=None, usage=True):
    """A chat server over a scripted rollout engine, as vLLM serves a model: it renders the messages with the chat
    template (continuing the final assistant message when asked), generates with the request's budget, stop strings
    and seed, drops a matched stop string from the text, says which stop ended the reply (``stop_reason``: the
    string, or ``eos_reason`` for an EOS: None, or a token id as vLLM gives for a model's extra EOS ids) and reports
    the generated tokens in ``usage`` (or, ``usage=False``, no usage at all)."""
    from arpo_algo.rollout.engines.base import GenRequest, SamplingParams

    tok = engine.tokenizer

    def reply(body):
        messages, cont = body["messages"], body.get("continue_final_message", False)
        text = tok.apply_chat_template(
            messages[:-1] if cont else messages, add_generation_prompt=True, tokenize=False
        ) + (messages[-1]["content"] if cont else "")
        params = SamplingParams(
            max_new_tokens=body["max_tokens"], stop=tuple(body.get("stop") or ()), seed=body["seed"]
        )
        gen = engine.generate([GenRequest(0, tok(text, add_special_tokens=False)["input_ids"], params)])[0]
        ids = gen.token_ids[:-1] if gen.finish_reason == "eos" else gen.token_ids
        content = tok.decode(ids, skip_special_tokens=False)
        if gen.stop_string:
            content = content[: -len(gen.stop_string)]
        stop_reason = gen.stop_string or (eos_reason if gen.finish_reason == "eos" else None)
        return {
            "content": content,
            "finish_reason": "length" if gen.finish_reason == "length" else "stop",
            "stop_reason": stop_reason,
            "usage": {"completion_tokens": len(gen.token_ids)} if usage else {},
        }

    return reply


def unclosed_call_engine():
    """A scripted model whose second call is cut short by its EOS inside the open tool tag (an invalid call)."""
    from tests.arpo_algo.rollout.test_sampler import CALL, ScriptedEngine

    class Unclosed(ScriptedEngine):
        def _turn(self, n_results, variant, limit):
            full = CALL.format(c="abcdefgh"[variant], n=variant)
            return full[: -len("</python>")] if n_results == 1 else full

    return Unclosed(calls=(3, 3))


@pytest.mark.parametrize(
    ("budget", "max_calls", "calls", "finish", "engine", "replies"),
    [
        (150, 3, 2, "length", None, {}),  # a call is 43 tokens and its result about 20: tool results decide the stop
        (600, 2, 2, "tool_limit", None, {}),  # the third call meets the limit: the EOS the rollout appends is counted
        (600, 3, 1, "eos", unclosed_call_engine, {}),  # an EOS inside an open tag ends the run, as the rollout ends it
        (600, 3, 1, "eos", unclosed_call_engine, {"eos_reason": 0}),  # ... also an EOS vLLM names by its token id
        (150, 3, 2, "length", None, {"usage": False}),  # a server without usage: counted with the tokenizer
        (600, 2, 2, "tool_limit", None, {"usage": False}),  # (stop strings and EOS included)
    ],
    ids=["budget", "tool_limit", "eos_in_open_tag", "eos_token_id", "budget_no_usage", "tool_limit_no_usage"],
)
def test_endpoint_budget_counts_tool_results_as_the_local_run(
    tiny_model_dir, tmp_path, capsys, budget, max_calls, calls, finish, engine, replies
):
    """The response budget counts every token after the prompt, tool results included, through an endpoint as in
    process: the same scripted model served over HTTP and run by run_engine makes the same tool calls, spends the
    same generated and response tokens and ends for the same reason per run. Counting generated tokens alone let
    the served model make more tool calls within the same --max-response-tokens."""
    from arpo_algo.eval.data import load_eval_data, make_eval_env
    from arpo_algo.eval.evaluation import EvalSettings
    from arpo_algo.eval.runner import run_engine
    from tests.arpo_algo.rollout.test_sampler import ScriptedEngine

    data = load_eval_data("toolmath", limit=3)

    def creator():
        return make_eval_env(data.env_id, {**data.env_config, "max_tool_calls": max_calls}, data.items)

    local = tmp_path / "local.jsonl"
    settings = EvalSettings(num_prompts=None, samples=2, temperature=0.6, max_response_tokens=budget, seed=5)
    make = engine or (lambda: ScriptedEngine(calls=(3, 3)))
    run_engine(make(), creator, data.items, settings, model="m", out_file=local, skip=set())
    out = tmp_path / "served"
    with StubServer(scripted_server(make(), **replies)) as server:
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--data",
                "toolmath",
                "--limit",
                "3",
                "--k",
                "2",
                "--max-response-tokens",
                str(budget),
                "--seed",
                "5",
                "--env-set",
                f"max_tool_calls={max_calls}",
                "--output",
                str(out),
                "--no-progress",
                "--no-charts",
            ]
        )
    assert rc == 0, capsys.readouterr().err
    served = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    ran = [json.loads(x) for x in local.read_text().splitlines()]
    keys = ("index", "run", "num_tool_calls", "generated_tokens", "response_tokens", "finish_reason")
    assert [{k: r[k] for k in keys} for r in served] == [{k: r[k] for k in keys} for r in ran]
    assert all(r["num_tool_calls"] == calls and r["finish_reason"] == finish for r in served)
    assert all(r["response_tokens"] == budget for r in served) == (finish == "length")


def test_endpoint_without_tokenizer_is_refused_before_the_run(tmp_path, capsys):
    """Tools run client-side need the served model's tokenizer to count their results against the budget: without
    it the run is refused with a hint, before anything is written."""
    out = tmp_path / "out"
    with StubServer(text_agent) as server:
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--data",
                str(_write_items(tmp_path)),
                "--env",
                "arpo/ToolMath-v0",
                "--output",
                str(out),
                "--no-progress",
                "--no-charts",
            ]
        )
    err = capsys.readouterr().err
    assert rc == 2 and "needs the served model's tokenizer" in err and "--tokenizer" in err and "Traceback" not in err
    assert not server.requests and not out.exists()


def test_a_tokenizer_that_does_not_load_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    """A --tokenizer folder with no tokenizer in it is refused with a hint (it was a transformers traceback); a folder
    holding only the tokenizer's files is enough."""
    from arpo_algo.eval.harness import load_tokenizer

    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with StubServer(text_agent) as server:
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--tokenizer",
                str(empty),
                "--data",
                str(_write_items(tmp_path)),
                "--env",
                "arpo/ToolMath-v0",
                "--output",
                str(tmp_path / "out"),
                "--no-progress",
                "--no-charts",
            ]
        )
    err = capsys.readouterr().err
    assert rc == 2 and "no tokenizer loads from" in err and "Traceback" not in err and not server.requests
    only = tmp_path / "tokenizer_only"
    only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (only / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert load_tokenizer(str(only)).encode("6 times 7") == load_tokenizer(str(tiny_model_dir)).encode("6 times 7")


def test_a_server_that_reports_no_usage_is_counted_or_refused(tmp_path, capsys):
    """Bug: a reply without ``usage`` counted as 0 generated tokens, so the budget never stopped such a server's runs.
    With --tokenizer the replies are counted with it (the parity test above, without usage); without one (an agent
    that runs its own tools needs none otherwise) the run stops with an error saying so."""

    def no_usage(body):
        return {**server_tools_agent(body), "usage": {}}

    with StubServer(no_usage, model_extra={"arpo": {"engine": "hf", "tools": ["python"]}}) as server:
        rc = main(
            [
                "eval",
                "--endpoint",
                server.url,
                "--data",
                str(_write_items(tmp_path)),
                "--env",
                "arpo/ToolMath-v0",
                "--k",
                "1",
                "--output",
                str(tmp_path / "out"),
                "--no-progress",
                "--no-charts",
                *PRIVATE_TOOLS,
            ]
        )
    err = capsys.readouterr().err
    assert rc == 2 and "no usage.completion_tokens" in err and "--tokenizer" in err and "Traceback" not in err
