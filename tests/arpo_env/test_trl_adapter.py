"""The TRL adapter against real TRL (``trl==1.16.*``, the ``bench`` extra): GRPOTrainer builds its tools from the
env's, resets one instance per rollout and scores through the env's reward, for one optimizer step on the tiny model.

Without TRL these tests skip, except with ARPO_REQUIRE_TRL=1 (set by scripts/test in CI, which installs the extra):
there a missing TRL fails them."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from arpo_base.errors import ArpoError, ConfigError


@pytest.fixture(scope="module")
def trl_installed():
    if importlib.util.find_spec("trl") is None:
        if os.environ.get("ARPO_REQUIRE_TRL") == "1":
            pytest.fail("ARPO_REQUIRE_TRL=1 (CI) but trl is not installed: scripts/test installs the bench extra")
        pytest.skip("trl is not installed (pip install 'arpo[bench]')")


def test_a_missing_trl_is_refused_naming_the_extra(monkeypatch):
    from arpo_env.adapters.trl import require_trl, trl_environment

    monkeypatch.setitem(sys.modules, "trl", None)  # what an environment without TRL imports
    with pytest.raises(ArpoError, match="TRL is not installed") as e:
        trl_environment("arpo/ToolMath-v0")
    assert 'pip install "arpo[bench]"' in e.value.hint
    with pytest.raises(ArpoError):
        require_trl()


def test_the_env_speaks_trls_tool_interface(trl_installed):
    from transformers.utils import get_json_schema

    from arpo_env.adapters.trl import trl_environment, trl_reward, trl_rows
    from arpo_env.core import ToolTextEnv

    Env = trl_environment("arpo/ToolMath-v0", levels=[1])
    rows = trl_rows(Env, 3)
    assert [r["task_index"] for r in rows] == [0, 1, 2] and "ground_truth" not in repr(rows)
    schema = get_json_schema(Env.python)["function"]  # what TRL shows the model
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    truth = ToolTextEnv(task="toolmath", levels=[1]).task_record(1)["ground_truth"]
    env = Env()
    assert env.reset(**rows[1]) is None
    assert env.python(code="print(6*7)").strip() == "42"
    right = [{"role": "assistant", "content": f"<answer>\\boxed{{{truth}}}</answer>"}]
    assert trl_reward([rows[1]["prompt"]], [right], [env]) == [1.0]
    env.reset(**rows[1])
    assert trl_reward([rows[1]["prompt"]], [[{"role": "assistant", "content": "no idea"}]], [env]) == [0.0]
    with pytest.raises(ConfigError, match="TRL parses JSON tool calls only"):
        trl_environment("arpo/ToolMath-v0", protocol="arpo")


def test_a_call_past_the_tool_limit_ends_the_episode_and_a_late_answer_scores_nothing(trl_installed):
    from arpo_env.adapters.trl import trl_environment, trl_reward, trl_rows
    from arpo_env.core import ToolTextEnv

    Env = trl_environment("arpo/ToolMath-v0", levels=[1], max_tool_calls=2)
    row = trl_rows(Env, 4)[3]
    truth = ToolTextEnv(task="toolmath", levels=[1]).task_record(3)["ground_truth"]
    env = Env()
    env.reset(**row)
    assert [env.python(code="print(1)").strip(), env.python(code="print(2)").strip()] == ["1", "2"]
    assert "limit" in env.python(code="print(3)")  # one call past max_tool_calls: the env ends the episode
    right = [{"role": "assistant", "content": f"<answer>\\boxed{{{truth}}}</answer>"}]
    assert trl_reward([row["prompt"]], [right], [env]) == [0.0]  # a late answer does not count
    assert "episode has ended" in env.python(code="print(4)")  # told to the model as a tool result, not run


def test_one_grpo_trainer_step_over_the_env(trl_installed, tiny_model_dir, tmp_path, monkeypatch):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    from arpo_env.adapters.trl import trl_environment, trl_reward, trl_rows

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Env = trl_environment("arpo/ToolMath-v0", levels=[1], max_tool_calls=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = qwen2_5_chat_template  # a template TRL parses tool calls for (same ChatML tokens)
    tokenizer.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_tool_calling_iterations=2,
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=trl_reward,
        args=args,
        train_dataset=Dataset.from_list(trl_rows(Env, 4)),
        processing_class=tokenizer,
        environment_factory=Env,
    )
    assert [t.__name__ for t in trainer.tools] == ["python"]
    trainer.train()
    assert trainer.state.global_step == 1
    logged = [x for x in trainer.state.log_history if "reward" in x]
    assert logged and 0.0 <= logged[0]["reward"] <= 1.0
    assert all(isinstance(e, Env) and e._reward is not None for e in trainer.environments)  # every rollout scored
