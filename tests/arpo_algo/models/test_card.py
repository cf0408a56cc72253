"""Model cards: the Hub's metadata block, a base's Hub id passed on through folders arpo wrote, the command line."""

from __future__ import annotations

import shutil
import sys

from arpo_algo.models.card import base_model_record, invoking_command, read_card, rewrite_card, write_model_card


def test_a_hub_id_becomes_base_model_and_is_passed_on_to_a_run_from_that_folder(tiny_model_dir, tmp_path):
    sft = tmp_path / "sft"
    shutil.copytree(tiny_model_dir, sft)
    base = {
        "name": "smollm2-135m-instruct",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "path": "/m",
        "fingerprint": "f",
    }
    write_model_card(sft, base=base, algorithm="SFT", env="arpo/ToolMath-v0", task="toolmath", command="arpo sft")
    meta = read_card(sft)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["library_name"] == "transformers"
    assert meta["tags"][-1] == "sft" and meta["arpo"]["command"] == "arpo sft"
    record = base_model_record(sft)  # RL from the SFT folder: still names the registered model it came from
    assert (record["name"], record["hub_id"], record["path"]) == (base["name"], base["hub_id"], str(sft.resolve()))
    assert len(record["fingerprint"]) == 64
    rewrite_card(sft, held_out={"accuracy": 0.5})
    assert read_card(sft)["arpo"]["held_out"] == {"accuracy": 0.5} and read_card(sft)["base_model"] == base["hub_id"]


def test_a_folder_without_a_card_reads_as_none_and_a_plain_base_has_no_hub_id(tiny_model_dir, tmp_path):
    assert read_card(tmp_path) is None
    (tmp_path / "README.md").write_text("# no metadata block\n")
    assert read_card(tmp_path) is None
    record = base_model_record(tiny_model_dir)
    assert record["name"] is None and record["hub_id"] is None


def test_the_command_is_written_as_a_user_would_retype_it(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/arpo", "train", "my exp.toml"])
    assert invoking_command() == "arpo train 'my exp.toml'"
    monkeypatch.setattr(sys, "argv", ["train.py", "--seed", "1"])
    assert invoking_command() == "python train.py --seed 1"


def test_a_registered_model_is_named_with_its_hub_id(tiny_model_dir, tmp_path, monkeypatch):
    """A run from a registered name (or from its folder in the cache) records that name and the Hub id it records."""
    from arpo_algo.models.store import COMPLETE_MARKER, REGISTRY

    monkeypatch.setenv("ARPO_HOME", str(tmp_path))
    cached = tmp_path / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_model_dir, cached)  # stands in for the pulled weights: only the folder's place matters
    (cached / COMPLETE_MARKER).touch()
    for given in ("smollm2-135m-instruct", str(cached)):
        record = base_model_record(given)
        assert (record["name"], record["hub_id"]) == ("smollm2-135m-instruct", REGISTRY[record["name"]].hub_id)
    write_model_card(tmp_path, base=record, algorithm="GRPO", env="arpo/ToolMath-v0", command="arpo train x.toml")
    assert read_card(tmp_path)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
