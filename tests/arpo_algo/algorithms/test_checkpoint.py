"""Checkpoints: bit-equal round trip, a servable HF policy folder, resume position, version check, rotation, and
data only: nothing in a checkpoint is executed when it is read."""

from __future__ import annotations

import json

import pytest
import torch

from arpo_algo.algorithms import ARPO, ARPOConfig
from arpo_algo.algorithms.checkpoint import CHECKPOINT_FORMAT, read_checkpoint_state
from arpo_algo.models.checkpoints import list_checkpoints
from arpo_algo.run.driver import save_checkpoint
from arpo_base.errors import ArpoError


def tiny_config(model_dir) -> ARPOConfig:
    return (
        ARPOConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
        # the entropy bonus keeps a gradient, so the update really changes the weights
        .training(model_path=str(model_dir), prompts_per_step=2, lr=1e-3, entropy_coef=0.01)
        .tree(budget=2, initial=1)
        .llm_rollouts(max_response_tokens=12, hf={"max_batch_size": 4})
    )


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """One algorithm after one iteration, and its checkpoint."""
    algo = tiny_config(tiny_model_dir).build_algo()
    algo.train()
    path = tmp_path_factory.mktemp("ckpt") / "c1"
    algo.save_to_path(str(path))
    yield algo, path
    algo.stop()


def _optim_tensors(algo) -> list[torch.Tensor]:
    state = algo.learner.optimizer.state_dict()["state"]
    return [v for s in state.values() for v in s.values() if torch.is_tensor(v)]


def test_round_trip_is_bit_equal_and_resumes_position(trained):
    algo, path = trained
    restored = ARPO.from_checkpoint(str(path))
    try:
        assert type(restored) is ARPO and restored.config.settings.tree.budget == 2
        assert restored.iteration == algo.iteration == 1
        for (name, a), (_, b) in zip(algo.learner.model.named_parameters(), restored.learner.model.named_parameters()):
            assert torch.equal(a, b), name
        ours, theirs = _optim_tensors(algo), _optim_tensors(restored)
        assert ours and len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
        assert restored.learner.step == algo.learner.step
        assert restored.prompts.get_state() == algo.prompts.get_state()
        # the restored run draws the same next prompts as the original would
        state = algo.prompts.get_state()
        expected = algo.prompts.next(3)
        algo.prompts.set_state(state)
        assert restored.prompts.next(3) == expected
        restored.train()
        assert restored.iteration == 2
    finally:
        restored.stop()


def test_a_trial_placed_on_a_node_restores_in_the_driver(trained, tmp_path):
    """A Tune trial's checkpoint holds its backend.main_resources; restoring it in the driver (the step after a sweep)
    runs it here instead of refusing the placement the driver cannot have."""
    import shutil

    _, path = trained
    placed = tmp_path / "placed"
    shutil.copytree(path, placed)
    marker = placed / "arpo_checkpoint.json"
    state = json.loads(marker.read_text())
    state["config"]["settings"]["backend"]["main_resources"] = {"node_a": 1.0}
    marker.write_text(json.dumps(state))
    assert read_checkpoint_state(str(placed))["config"]["settings"]["backend"]["main_resources"] == {"node_a": 1.0}
    restored = ARPO.from_checkpoint(str(placed))
    try:
        assert restored.config.settings.backend.main_resources == {} and restored.iteration == 1
    finally:
        restored.stop()


def test_policy_folder_is_a_plain_hf_model(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    algo, path = trained
    model = AutoModelForCausalLM.from_pretrained(path / "policy")
    tok = AutoTokenizer.from_pretrained(path / "policy")
    ids = torch.tensor([tok.encode("12 + 7 =")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, algo.learner.model(ids).logits)
    assert tok.chat_template


def test_restore_from_path_into_a_fresh_algorithm(trained, tiny_model_dir):
    algo, path = trained
    fresh = tiny_config(tiny_model_dir).build_algo()
    try:
        fresh.restore_from_path(str(path))
        assert fresh.iteration == 1
        for a, b in zip(algo.learner.model.parameters(), fresh.learner.model.parameters()):
            assert torch.equal(a, b)
        assert fresh.engine.model is fresh.learner.model  # the engine sees the restored weights
    finally:
        fresh.stop()


def test_incompatible_checkpoints_are_refused(trained, tmp_path):
    import shutil

    _, path = trained
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    meta = json.loads((bad / "arpo_checkpoint.json").read_text())
    meta["arpo_checkpoint_format"] = CHECKPOINT_FORMAT + 1
    (bad / "arpo_checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ArpoError, match="incompatible checkpoint"):
        ARPO.from_checkpoint(str(bad))
    with pytest.raises(ArpoError, match="not an arpo checkpoint"):
        read_checkpoint_state(tmp_path)


def test_rotation_keeps_the_newest(trained, tmp_path):
    algo, _ = trained
    root = tmp_path / "checkpoints"
    first = save_checkpoint(algo, root, keep=1)
    algo._iteration += 1  # pretend one more iteration ran: a second name
    try:
        second = save_checkpoint(algo, root, keep=1)
    finally:
        algo._iteration -= 1
    assert list_checkpoints(root) == [second] and not first.exists()
    assert not any(p.name.startswith(".") for p in root.iterdir())


def test_checkpoint_records_the_package_version(trained):
    """One version source: the package metadata (pyproject.toml), written into every checkpoint."""
    import importlib.metadata
    import re
    from pathlib import Path

    import arpo_algo

    _, path = trained
    meta = json.loads((path / "arpo_checkpoint.json").read_text())
    assert meta["arpo_version"] == arpo_algo.__version__ == importlib.metadata.version("arpo")
    repo = Path(__file__).resolve().parents[3]
    hard_coded = [
        p
        for p in (repo / "arpo_algo").rglob("*.py")
        if re.search(r"__version__\s*=\s*['\"]\d+\.\d+", p.read_text(encoding="utf-8"))
    ]
    assert hard_coded == []


def test_a_checkpoint_holds_data_only(trained):
    """No pickle of arbitrary objects: JSON, safetensors, tokenizer files, and a trainer state of tensors and plain
    values that torch reads with weights_only=True."""
    _, path = trained
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert not [f for f in files if f.endswith((".pkl", ".bin", ".pickle"))], files
    assert "policy/model.safetensors" in files and "arpo_checkpoint.json" in files
    state = torch.load(path / "policy" / "trainer_state.pt", weights_only=True)
    assert {"optimizer", "scheduler", "rng", "step"} <= set(state)


def _planted_pickle(marker) -> bytes:
    """A pickle that creates ``marker`` when it is unpickled (what a hostile run folder would carry)."""
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return pickle.dumps({"training_iteration": 1, "x": Payload()})


def test_a_planted_pickle_is_not_executed(trained, tmp_path, tiny_model_dir):
    """A trainer state replaced by a hostile pickle, and a folder of pickles without arpo's marker (RLlib's own
    layout): both are refused with a clear error, and the payload never runs."""
    import shutil

    _, path = trained
    marker = tmp_path / "pwned"
    hostile = tmp_path / "hostile"
    shutil.copytree(path, hostile)
    (hostile / "policy" / "trainer_state.pt").write_bytes(_planted_pickle(marker))
    fresh = tiny_config(tiny_model_dir).build_algo()
    try:
        with pytest.raises(ArpoError, match="other than tensors and plain values"):
            fresh.restore_from_path(str(hostile))
        legacy = tmp_path / "legacy"
        legacy.mkdir()
        (legacy / "rllib_checkpoint.json").write_text(json.dumps({"arpo_checkpoint_format": 1}))
        (legacy / "algorithm_state.pkl").write_bytes(_planted_pickle(marker))
        with pytest.raises(ArpoError, match="is not an arpo checkpoint"):
            fresh.restore_from_path(str(legacy))
        with pytest.raises(ArpoError, match="is not an arpo checkpoint"):
            ARPO.from_checkpoint(str(legacy))
    finally:
        fresh.stop()
    assert not marker.exists()


def test_the_exported_policy_folder_is_served_as_it_was_trained(trained, tmp_path):
    """Bug: a policy folder on its own (the checkpoint's policy/ copied out, the quickstart's exported policy/)
    recorded no environment, so `arpo serve` gave it the generic protocol prompt and the session's default tool limit
    instead of those it was trained with. Each policy folder now carries its environment record (JSON, versioned),
    and an export keeps it; command-line values still win."""
    from arpo_algo.run.quickstart import stage_export
    from arpo_env.tasks.toolmath import SYSTEM_PROMPT
    from serve.agents import build_specs

    _, path = trained
    exported = stage_export(tmp_path, str(path / "policy"))["path"]
    [spec] = build_specs([exported], tools="python")
    assert (spec.session.get("system_prompt"), spec.session.get("max_tool_calls"), spec.session.get("protocol")) == (
        SYSTEM_PROMPT,
        1,
        "arpo",
    )
    [spec] = build_specs([exported], tools="python", system_prompt="mine", max_tool_calls=3, protocol="json")
    assert (spec.session["system_prompt"], spec.session["max_tool_calls"], spec.session["protocol"]) == (
        "mine",
        3,
        "json",
    )
    from arpo_algo.models.policy_env import POLICY_ENV_FILE, POLICY_ENV_FORMAT

    record = json.loads((tmp_path / "policy" / POLICY_ENV_FILE).read_text())
    assert record["arpo_policy_format"] == POLICY_ENV_FORMAT
    # the checkpoint's own environment record, unchanged
    assert (record["env"], record["env_config"]) == tuple(
        json.loads((path / "arpo_checkpoint.json").read_text())["config"][k] for k in ("env", "env_config")
    )


def test_listing_skips_folders_that_only_look_like_checkpoints(tmp_path):
    """A folder named ``iter_x`` (or ``iter_`` plus non-ASCII digits) beside real checkpoints is not one: the listing
    skips it instead of failing on its number."""
    root = tmp_path / "checkpoints"
    for name in ("iter_000002", "iter_x", "iter_", "iter_\u0663", "iter_000010"):
        (root / name).mkdir(parents=True)
        (root / name / "arpo_checkpoint.json").write_text("{}")
    assert [p.name for p in list_checkpoints(root)] == ["iter_000002", "iter_000010"]


def test_policy_and_export_folders_carry_a_model_card(trained, tiny_model_dir, tmp_path):
    """The Hub's metadata block (library, tags; base_model only for a Hub id) and what made the folder; the export
    adds the held-out score the quickstart measured."""
    import yaml

    from arpo_algo.models.card import read_card
    from arpo_algo.models.lora import weights_fingerprint
    from arpo_algo.run.quickstart import stage_export

    _, path = trained
    text = (path / "policy" / "README.md").read_text()
    assert text.startswith("---\n") and "# ARPO policy" in text
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta == read_card(path / "policy")
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"arpo", "reinforcement-learning", "tool-use"} <= set(meta["tags"]) and "base_model" not in meta
    a = meta["arpo"]
    assert (a["algorithm"], a["env"], a["task"]) == ("ARPO", "arpo/ToolMath-v0", "toolmath")
    assert a["base_fingerprint"] == weights_fingerprint(tiny_model_dir) and a["command"]
    assert a["base_model_path"] == str(tiny_model_dir.resolve()) and a["held_out"] is None
    record = json.loads((path / "policy" / "arpo_policy.json").read_text())["base_model"]
    assert (record["fingerprint"], record["name"]) == (a["base_fingerprint"], None)
    held_out = {"accuracy": 0.25, "num_tasks": 8, "split": "test"}
    exported = stage_export(tmp_path, str(path / "policy"), held_out)["path"]
    card = read_card(exported)
    assert card["arpo"]["held_out"] == held_out and card["arpo"]["base_fingerprint"] == a["base_fingerprint"]
    assert "accuracy 0.250 (split test, num_tasks 8)" in (tmp_path / "policy" / "README.md").read_text()
