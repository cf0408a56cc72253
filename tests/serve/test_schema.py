"""Request validation: every client mistake is a 400 (404 for the model) naming the field, OpenAI style."""

from __future__ import annotations

import json

import pytest

from arpo_base.errors import ArpoError
from serve.agents import build_specs, parse_tools, resolve_source
from serve.schema import APIError, parse_chat_request

#: A model folder's config.json as far as recognising it goes, and the record `arpo train` writes into a run folder.
MODEL_CONFIG = '{"model_type": "llama"}'
RUN_RECORD = '{"experiment": {}, "settings": {}, "arpo_version": "0.1.0"}'

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PYTHON_TOOL = {
    "type": "function",
    "function": {"name": "python", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}},
}


def err(body) -> APIError:
    with pytest.raises(APIError) as e:
        parse_chat_request(body if isinstance(body, (bytes, str)) else json.dumps(body))
    assert e.value.status == 400
    return e.value


def test_valid_request_defaults_and_fields():
    r = parse_chat_request(
        json.dumps(
            {
                **OK,
                "temperature": 0,
                "top_p": 0.5,
                "max_tokens": 7,
                "n": 3,
                "stop": "x",
                "seed": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
                "user": "ignored",
            }
        )
    )
    assert (r.temperature, r.top_p, r.max_tokens, r.n, r.stop, r.seed, r.stream, r.include_usage) == (
        0.0,
        0.5,
        7,
        3,
        ["x"],
        5,
        True,
        True,
    )
    r = parse_chat_request(OK)
    assert (r.temperature, r.top_p, r.max_tokens, r.n, r.stop, r.tool_mode) == (1.0, 1.0, None, 1, [], "server")
    assert parse_chat_request({**OK, "tools": [PYTHON_TOOL]}).tool_mode == "client"
    parts = {
        **OK,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    }
    assert parse_chat_request(parts).messages[0]["content"] == "ab"


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        ([1, 2], None),
        ({"messages": OK["messages"]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "messages[1].role",
        ),
        ({**OK, "temperature": "hot"}, "temperature"),
        ({**OK, "temperature": 2.5}, "temperature"),
        ({**OK, "temperature": True}, "temperature"),
        ({**OK, "top_p": 0}, "top_p"),
        ({**OK, "top_p": 1.5}, "top_p"),
        ({**OK, "max_tokens": 0}, "max_tokens"),
        ({**OK, "max_tokens": 1.5}, "max_tokens"),
        ({**OK, "n": 0}, "n"),
        ({**OK, "n": 1000}, "n"),
        ({**OK, "stop": ["a", ""]}, "stop"),
        ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**OK, "seed": "x"}, "seed"),
        ({**OK, "stream": "yes"}, "stream"),
        ({**OK, "temprature": 1}, "temprature"),
        ({**OK, "tool_choice": "required"}, "tool_choice"),
        ({**OK, "arpo": {"max_tool_calls": -1}}, "arpo.max_tool_calls"),
        ({**OK, "arpo": {"tool_mode": "both"}}, "arpo.tool_mode"),
        ({**OK, "arpo": {"colour": 1}}, "arpo"),
        ({**OK, "tools": [{"type": "function"}]}, "tools[0]"),
        ({**OK, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({**OK, "logprobs": "yes"}, "logprobs"),
        ({**OK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**OK, "top_logprobs": 2}, "top_logprobs"),
        ({**OK, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({**OK, "stream": True, "stream_options": {"colour": True}}, "stream_options.colour"),
        ({**OK, "user": 5}, "user"),
        ({**OK, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({**OK, "metadata": {"a": 1}}, "metadata"),
    ],
)
def test_bad_inputs_name_the_field(body, param):
    e = err(body)
    assert e.param == param
    b = e.body()["error"]
    assert b["type"] == "invalid_request_error" and b["param"] == param and b["message"]


#: Each field that would change the answer, at a value this server does not honour (refused, naming the field).
CHANGING = [
    ("frequency_penalty", 0.5),
    ("presence_penalty", -1),
    ("logit_bias", {"42": 100}),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("store", True),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("service_tier", "flex"),
    ("verbosity", "low"),
    ("reasoning_effort", "low"),
    ("web_search_options", {}),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "none"),
]
#: The neutral values stock clients send: accepted (they do not change the answer).
NEUTRAL = [
    ("frequency_penalty", 0),
    ("presence_penalty", 0.0),
    ("logit_bias", {}),
    ("response_format", {"type": "text"}),
    ("store", False),
    ("modalities", ["text"]),
    ("service_tier", "auto"),
    ("verbosity", "medium"),
    ("functions", []),
    ("function_call", "auto"),
    ("user", "episode-7"),
    ("safety_identifier", "u1"),
    ("prompt_cache_key", "k"),
    ("metadata", {"run": "a"}),
    ("parallel_tool_calls", False),
    ("parallel_tool_calls", True),
    ("prediction", {"type": "content", "content": "x"}),
    ("audio", None),
    ("reasoning_effort", None),
]


@pytest.mark.parametrize("key, value", CHANGING)
def test_a_field_that_would_change_the_answer_is_refused_naming_it(key, value):
    e = err({**OK, key: value})
    assert e.param == key and f"'{key}'" in e.message and "not supported" in e.message


@pytest.mark.parametrize("key, value", NEUTRAL)
def test_neutral_values_stock_clients_send_pass(key, value):
    parse_chat_request({**OK, key: value})


def test_logprobs_and_stream_options_are_read():
    r = parse_chat_request({**OK, "logprobs": True, "top_logprobs": 3})
    assert (r.logprobs, r.top_logprobs) == (True, 3)
    r = parse_chat_request({**OK, "logprobs": False})
    assert (r.logprobs, r.top_logprobs) == (False, 0)
    r = parse_chat_request(
        {**OK, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    )
    assert r.include_usage


def test_tools_must_be_the_agents_trained_tools_with_their_parameters():
    from arpo_env.session import ToolSession
    from serve.openai_api import check_tools

    trained = {n: t.schema() for n, t in ToolSession({"tools": {"python": {}}}).tools.items()}
    check_tools([PYTHON_TOOL], trained)  # descriptions and "required" left out: the same call
    check_tools([{"type": "function", "function": trained["python"]["function"]}], trained)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(APIError) as e:
        check_tools([PYTHON_TOOL, weather], trained)
    assert e.value.param == "tools[1].function.name" and "get_weather" in e.value.message
    assert "trained on: python" in e.value.message
    for params in (
        {"type": "object", "properties": {"source": {"type": "string"}}},
        {"type": "object", "properties": {"code": {"type": "integer"}}},
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code", "x"]},
        None,
    ):
        other = {"type": "function", "function": {"name": "python", "parameters": params}}
        with pytest.raises(APIError) as e:
            check_tools([other], trained)
        assert e.value.param == "tools[0].function.parameters"
        assert json.dumps(trained["python"]["function"]["parameters"]) in e.value.message


def test_vllm_logprobs_are_served_only_where_they_mean_what_the_docs_say():
    from serve.openai_api import logprob_problem

    assert logprob_problem("hf", {}, 0.7) is None
    assert logprob_problem("vllm", {}, 1.0) is None and logprob_problem("vllm", {}, 0.0) is None
    assert "temperature 1" in logprob_problem("vllm", {}, 0.7)
    assert "raw_logprobs" in logprob_problem("vllm", {"logprobs_mode": "processed_logprobs"}, 1.0)


def test_typo_suggests_the_closest_name():
    assert "did you mean 'temperature'" in err({**OK, "temprature": 1}).message


def test_sources_model_checkpoint_and_run_folder(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(MODEL_CONFIG)
    assert resolve_source(str(model)) == ("m", model)
    assert resolve_source(f"sft={model}") == ("sft", model)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(RUN_RECORD)  # what arpo train writes: it does not make the run a model folder
    for it in (1, 2):
        ck = run / "checkpoints" / f"iter_{it:06d}"
        (ck / "policy").mkdir(parents=True)
        (ck / "policy" / "config.json").write_text(MODEL_CONFIG)
        (ck / "arpo_checkpoint.json").write_text("{}")
    assert resolve_source(str(run)) == ("run", run / "checkpoints" / "iter_000002" / "policy")
    assert resolve_source(str(run / "checkpoints" / "iter_000001")) == (
        "run",
        run / "checkpoints" / "iter_000001" / "policy",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArpoError, match="is not a model source"):
        resolve_source(str(empty))
    with pytest.raises(ArpoError, match="two agents are named"):
        build_specs([str(model), f"m={model}"])
    with pytest.raises(ArpoError, match="unknown engine"):
        build_specs([str(model)], engine="tgi")
    with pytest.raises(ArpoError, match="unknown session config key|tool"):
        build_specs([str(model)], tools='{"pyhton": {}}')
    assert parse_tools("python, search") == {"python": {}, "search": {}}
    assert parse_tools('{"python": {"timeout_s": 3}}') == {"python": {"timeout_s": 3}}


def test_engine_settings_are_checked_before_any_replica_starts(tmp_path):
    """A setting the chosen engine does not take, or engine='vllm' without vllm, fails in build_specs (the command
    line) with a ConfigError and a hint, not as a TypeError in a replica."""
    import importlib.util

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(MODEL_CONFIG)
    with pytest.raises(ArpoError, match="'kv_cache_gib' is not a setting of the hf engine") as e:
        build_specs([str(model)], engine="hf", engine_settings={"kv_cache_gib": 1})
    assert "max_batch_size" in e.value.hint
    assert build_specs([str(model)], engine="hf", engine_settings={"max_batch_size": 4})[0].engine_settings == {
        "max_batch_size": 4
    }
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ArpoError, match="needs the vllm package") as e:
            build_specs([str(model)], engine="vllm")
        assert "install_vllm_cpu" in e.value.hint
    else:
        with pytest.raises(ArpoError, match="'max_batch_size' is not a setting of the vllm engine") as e:
            build_specs([str(model)], engine="vllm", engine_settings={"max_batch_size": 4})
        assert "schedules its own batches" in e.value.hint
        assert build_specs([str(model)], engine="vllm", engine_settings={"kv_cache_gib": 0.5})[0].engine == "vllm"


def test_application_builder_takes_serve_run_arguments(tmp_path):
    """``serve run serve.app:build key=value ...`` passes strings; the builder turns them into the deployment."""
    from ray.serve import Application

    from serve.app import AUTOSCALING, SERVE_HEADROOM, build, deployment_options

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(MODEL_CONFIG)
    app = build(
        {
            "models": f"a={model},b={model}",
            "tools": "python",
            "max_tool_calls": "3",
            "replicas": "2",
            "max_ongoing_requests": "4",
            "max_queued_requests": "8",
            "retry_after_s": "2",
            "allow_unauthenticated": "true",
        }
    )
    assert isinstance(app, Application)
    opts = deployment_options(replicas=2, max_ongoing_requests=4, max_queued_requests=8, retry_after_s=2)
    assert opts["num_replicas"] == 2  # Serve's limits sit above the replica's own admission (4 running, 8 waiting)
    assert opts["max_ongoing_requests"] == 4 + 8 + SERVE_HEADROOM and opts["max_queued_requests"] == 8 + SERVE_HEADROOM
    with pytest.raises(ArpoError, match="max_queued_requests >= 0, got 4 and -1"):  # no unbounded queue (Serve's -1)
        deployment_options(max_ongoing_requests=4, max_queued_requests=-1)
    assert opts["backpressure_config"].status_code == 503 and opts["backpressure_config"].retry_after_s == 2
    auto = deployment_options(autoscale=True)
    assert auto["autoscaling_config"]["target_ongoing_requests"] == AUTOSCALING["target_ongoing_requests"]
    assert "num_replicas" not in auto
    with pytest.raises(ArpoError, match="nothing to serve"):
        build({"allow_unauthenticated": "true"})


def test_serve_refuses_a_python_tool_below_the_minimum_isolation(tiny_model_dir, capsys):
    """Without namespaces the model's code would reach the network: `arpo serve` refuses before anything starts,
    naming the opt-in; with the opt-in the specs carry it to every replica's tool."""
    from arpo_algo.cli.main import main
    from tests.arpo_env.test_sandbox_isolation import _system_python

    spec = {"backend": "subprocess", "namespaces": False, "python_executable": _system_python(), "timeout_s": 10}
    assert main(["serve", str(tiny_model_dir), "--tools", json.dumps({"python": spec})]) == 2
    err = capsys.readouterr().err
    assert "below the minimum 'process'" in err and "--allow-unisolated-python" in err and "Traceback" not in err
    specs = build_specs([str(tiny_model_dir)], tools={"python": spec}, allow_unisolated_python=True)
    assert specs[0].session["tools"]["python"]["allow_unisolated_python"] is True
    safe = build_specs([str(tiny_model_dir)], tools="python")  # the default sandbox here meets the minimum
    assert "allow_unisolated_python" not in safe[0].session["tools"]["python"]


def test_replica_placement_options_are_checked(tiny_model_dir, capsys):
    """Replica resources reach Serve as the replicas' custom resources; a bad table is refused before Ray starts."""
    from arpo_algo.cli.main import main
    from serve.app import deployment_options

    opts = deployment_options(replicas=2, replica_resources={"worker": 1}, max_replicas_per_node=1)
    assert opts["ray_actor_options"]["resources"] == {"worker": 1.0} and opts["max_replicas_per_node"] == 1
    assert "resources" not in deployment_options()["ray_actor_options"]
    for table, message in (
        ({"CPU": 1}, "'CPU' is not a custom resource"),
        ({"worker": 0}, "worker must be a number"),
        ({}, "non-empty table"),
    ):
        with pytest.raises(ArpoError, match=message):
            deployment_options(replica_resources=table)
    with pytest.raises(ArpoError, match="max_replicas_per_node must be >= 1"):
        deployment_options(max_replicas_per_node=0)
    assert main(["serve", str(tiny_model_dir), "--replica-resources", "{worker: 1}"]) == 2
    err = capsys.readouterr().err
    assert "--replica-resources must be a JSON object" in err and "Traceback" not in err


def test_a_checkpoint_is_served_with_the_prompt_and_limits_it_was_trained_with(tmp_path):
    """Bug: a served checkpoint got the generic protocol prompt and the session's default tool limit (4), not those
    of its training environment (ToolMath's prompt, the experiment's limit), so the chat page, which sends no system
    message, put the agent outside what it learned. Flags still win; a plain model folder records nothing."""
    import json

    import gymnasium as gym

    import arpo_env  # noqa: F401  (registers the ids)
    from arpo_algo.algorithms.checkpoint import CHECKPOINT_FORMAT
    from arpo_algo.models.policy_env import served_defaults, write_policy_env
    from arpo_env.tasks.toolmath import SYSTEM_PROMPT

    ck = tmp_path / "run" / "checkpoints" / "iter_000003"
    (ck / "policy").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(RUN_RECORD)
    (ck / "policy" / "config.json").write_text(MODEL_CONFIG)
    env_config = {"levels": [3], "max_tool_calls": 3}
    (ck / "arpo_checkpoint.json").write_text(
        json.dumps(
            {
                "arpo_checkpoint_format": CHECKPOINT_FORMAT,
                "config": {"env": "arpo/ToolMath-v0", "env_config": env_config, "seed": 0},
            }
        )
    )
    # without the policy folder's own record the checkpoint's environment is not rebuilt: generic defaults
    [spec] = build_specs([str(tmp_path / "run")], tools="python")
    assert not set(spec.session) & {"system_prompt", "max_tool_calls", "protocol"}
    # the record a checkpoint's policy folder gets, written as training writes it (from the environment itself)
    env = gym.make("arpo/ToolMath-v0", config=dict(env_config), disable_env_checker=True).unwrapped
    try:
        write_policy_env(ck / "policy", "arpo/ToolMath-v0", env_config, served_defaults(env))
    finally:
        env.close()
    [spec] = build_specs([str(tmp_path / "run")], tools="python")
    assert spec.session["system_prompt"] == SYSTEM_PROMPT and spec.session["max_tool_calls"] == 3
    assert spec.session["protocol"] == "arpo"
    [spec] = build_specs([str(ck)], tools="python", max_tool_calls=1, system_prompt="mine")
    assert (spec.session["system_prompt"], spec.session["max_tool_calls"]) == ("mine", 1)  # the command line wins
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(MODEL_CONFIG)
    [spec] = build_specs([str(plain)], tools="python")
    assert not set(spec.session) & {"system_prompt", "max_tool_calls", "protocol"}


def _record(**over) -> dict:
    """A policy folder's arpo_policy.json; its format number is the on-disk contract (readers refuse any other)."""
    return {
        "arpo_policy_format": 1,
        "arpo_version": "0",
        "env": "arpo/ToolMath-v0",
        "env_config": {"levels": [3]},
        "served_defaults": {"system_prompt": "trained prompt", "max_tool_calls": 3, "protocol": "json"},
        **over,
    }


def test_a_policy_folder_records_its_environment_or_serve_says_it_uses_generic_defaults(tmp_path, caplog):
    """A policy folder with arpo_policy.json is served with the settings it records (the command line wins); one
    without (a base model, an sft output) keeps the generic defaults, and serve says so once, naming them."""
    import logging

    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text(MODEL_CONFIG)
    with caplog.at_level(logging.WARNING, logger="arpo.serve"):
        [spec] = build_specs([str(folder)], tools="python", max_tool_calls=2)
    assert not set(spec.session) & {"system_prompt", "protocol"} and spec.session["max_tool_calls"] == 2
    [said] = [r.getMessage() for r in caplog.records if r.name == "arpo.serve"]
    assert "records no training environment" in said and "generic prompt of the 'arpo' protocol" in said
    assert "--system-prompt" in said and "--protocol" in said and "max_tool_calls" not in said  # given, not defaulted
    (folder / "arpo_policy.json").write_text(json.dumps(_record()))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="arpo.serve"):
        [spec] = build_specs([str(folder)], tools="python")
    assert (spec.session["system_prompt"], spec.session["max_tool_calls"], spec.session["protocol"]) == (
        "trained prompt",
        3,
        "json",
    )
    assert not [r for r in caplog.records if r.name == "arpo.serve"]
    [spec] = build_specs([str(folder)], tools="python", protocol="json", max_tool_calls=1)
    assert (spec.session["system_prompt"], spec.session["max_tool_calls"], spec.session["protocol"]) == (
        "trained prompt",
        1,
        "json",
    )
    # the training prompt describes its own protocol's format: under another protocol it is not used, and serve says so
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="arpo.serve"):
        [spec] = build_specs([str(folder)], tools="python", protocol="arpo")
    assert "system_prompt" not in spec.session and spec.session["protocol"] == "arpo"
    [said] = [r.getMessage() for r in caplog.records if r.name == "arpo.serve"]
    assert "trained with protocol 'json'" in said and "--system-prompt" in said
    [spec] = build_specs([str(folder)], tools="python", protocol="arpo", system_prompt="mine")
    assert spec.session["system_prompt"] == "mine"


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ("[1]", "must hold a JSON object"),
        ({"arpo_policy_format": 99}, "has format 99"),
        ({"served_defaults": None}, "lacks 'env'"),
        ({"served_defaults": {"system_prompt": "p", "protocol": "arpo"}}, "lacks max_tool_calls"),
        (
            {"served_defaults": {"system_prompt": "p", "max_tool_calls": "3", "protocol": "arpo"}},
            "max_tool_calls must be an integer",
        ),
        (
            {"served_defaults": {"system_prompt": "p", "max_tool_calls": 3, "protocol": "xml"}},
            "protocol must be one of",
        ),
    ],
    ids=["not-json", "not-object", "format", "no-defaults", "missing-key", "limit-type", "protocol"],
)
def test_an_unreadable_policy_record_is_refused_with_a_hint(tmp_path, content, message):
    """Never skipped (the agent would silently get settings it was not trained with), never a traceback."""
    from arpo_base.errors import ConfigError

    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text(MODEL_CONFIG)
    (folder / "arpo_policy.json").write_text(content if isinstance(content, str) else json.dumps(_record(**content)))
    with pytest.raises(ConfigError, match=message) as err:
        build_specs([str(folder)], tools="python")
    # a ConfigError: the CLI prints its message and hint as two lines, no traceback (arpo_algo.cli.main)
    assert "arpo_policy.json" in err.value.message and "--system-prompt" in err.value.hint


def test_a_refusal_of_arpo_serve_starts_no_ray(tmp_path, capsys, monkeypatch):
    """Bug: `arpo serve` shut Serve down on its way out even when it refused its input before Ray started, and that
    shutdown started a local Ray instance (seconds, and processes) only to stop it."""
    import ray

    from arpo_algo.cli.main import main

    if ray.is_initialized():  # left by another test in this process
        ray.shutdown()
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text(MODEL_CONFIG)
    (folder / "arpo_policy.json").write_text("{not json")
    import shutil
    import tempfile
    from pathlib import Path

    ray_dir = Path(tempfile.mkdtemp(prefix="r"))  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", str(ray_dir))  # where a Ray started now would put its session
    try:
        assert main(["serve", str(folder)]) == 2
        err = capsys.readouterr().err
        assert "arpo_policy.json" in err and "Traceback" not in err
        assert not ray.is_initialized() and not any(ray_dir.iterdir())
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
