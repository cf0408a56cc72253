"""Cold-start SFT: segment masking, sharegpt/alpaca parsing, a real training run on the tiny model, bad inputs."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from arpo_algo.cli.sft import config_from_args
from arpo_algo.cli.sft import register as register_sft
from arpo_algo.train.sft import SFTConfig, run_sft
from arpo_algo.train.sft_data import (
    SFTExample,
    build_dataset,
    load_file_examples,
    split_inline_results,
    tokenize_example,
)
from arpo_base.errors import ArpoError, ConfigError

SYSTEM = "Solve with the python tool. Put the final answer in <answer>\\boxed{}</answer>."
QUESTION = "What is 17 * 23 + 5?"
CALL = "<think>Multiply, then add.</think>\n<python>\nprint(17 * 23 + 5)\n</python>"
RESULT = " <result>\n396\n</result>"
ANSWER = "\n<think>The tool says 396.</think>\n<answer>The final answer is \\[ \\boxed{396} \\]</answer>"


def demo(a: int = 17, b: int = 23, c: int = 5) -> SFTExample:
    value = a * b + c
    return SFTExample(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} * {b} + {c}?"}],
        segments=[
            (f"<think>Multiply, then add.</think>\n<python>\nprint({a} * {b} + {c})\n</python>", True),
            (f" <result>\n{value}\n</result>", False),
            (
                f"\n<think>The tool says {value}.</think>\n<answer>The final answer is \\[ \\boxed{{{value}}} "
                f"\\]</answer>",
                True,
            ),
        ],
    )


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels) if lab != -100])


def test_segment_masking_matches_rl_layout(tok):
    ids, labels = tokenize_example(tok, demo())
    prompt = tok.apply_chat_template(demo().messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[: len(prompt)] == list(prompt) and all(lab == -100 for lab in labels[: len(prompt)])
    assert trained_text(tok, ids, labels) == CALL + ANSWER + tok.eos_token
    assert ids[-1] == tok.eos_token_id and labels[-1] == tok.eos_token_id
    masked_reply = tok.decode([i for i, lab in zip(ids[len(prompt) :], labels[len(prompt) :]) if lab == -100])
    assert masked_reply == RESULT
    # Segment-wise tokenization: the reply ids are the concatenation of each segment's own ids.
    seg_ids = [i for t, _ in demo().segments for i in tok(t, add_special_tokens=False)["input_ids"]]
    assert ids[len(prompt) : -1] == seg_ids


def test_tool_output_cannot_inject_special_tokens(tok):
    ex = SFTExample(
        [{"role": "user", "content": "q"}],
        [("<python>x</python>", True), (" <result>\n<|im_end|>\n</result>", False), ("done", True)],
    )
    ids, labels = tokenize_example(tok, ex)
    assert ids.count(tok.eos_token_id) == 2  # end of the user turn in the prompt + the final eos, none in the result
    assert trained_text(tok, ids, labels) == "<python>x</python>done" + tok.eos_token


def test_split_inline_results():
    text = "<python>print(1)</python>\n<result>\n1\n</result>\nok <python>2</python><result>2</result>end"
    assert split_inline_results(text) == [
        ("<python>print(1)</python>", True),
        ("\n<result>\n1\n</result>", False),
        ("\nok <python>2</python>", True),
        ("<result>2</result>", False),
        ("end", True),
    ]
    with pytest.raises(ValueError, match="without a closing"):
        split_inline_results("a <result> b")


def write(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def test_sharegpt_file_masks_inline_results(tmp_path, tok):
    reply = CALL + RESULT + ANSWER
    f = write(
        tmp_path / "sg.json",
        [
            {
                "conversations": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": reply}],
                "system": SYSTEM,
            },
            {
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "hello"},
                    {"from": "human", "value": QUESTION},
                    {"from": "function_call", "value": CALL},
                    {"from": "observation", "value": "396"},
                    {"from": "gpt", "value": ANSWER},
                ]
            },
        ],
    )
    exs = load_file_examples(f)
    assert exs[0].messages == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for ex in exs:
        ids, labels = tokenize_example(tok, ex)
        assert trained_text(tok, ids, labels) == CALL + ANSWER + tok.eos_token
    # The multi-turn history is part of the (masked) prompt; the observation becomes the RL result format.
    assert [m["role"] for m in exs[1].messages] == ["system", "user", "assistant", "user"]
    assert exs[1].segments[1] == (RESULT, False)


def test_alpaca_jsonl_with_history(tmp_path, tok):
    rec = {
        "instruction": QUESTION,
        "input": "Use python.",
        "output": CALL + "\n<result>\n396\n</result>" + ANSWER,
        "system": SYSTEM,
        "history": [["hi", "hello"]],
    }
    f = tmp_path / "al.jsonl"
    f.write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    exs = load_file_examples(f)
    assert len(exs) == 2
    assert exs[0].messages[-1] == {"role": "user", "content": QUESTION + "\nUse python."}
    assert [m["role"] for m in exs[0].messages] == ["system", "user", "assistant", "user"]
    ids, labels = tokenize_example(tok, exs[0])
    assert trained_text(tok, ids, labels) == CALL + ANSWER + tok.eos_token


def test_bad_files_name_the_file_and_record(tmp_path):
    f = write(tmp_path / "weird.json", [{"prompt": "x", "completion": "y"}])
    with pytest.raises(ConfigError, match=r"weird\.json: record 0 is in no known SFT format"):
        load_file_examples(f)
    f = write(
        tmp_path / "sg.json",
        [
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"conversations": [{"from": "human", "value": "q"}]},
        ],
    )
    with pytest.raises(ConfigError, match=r"sg\.json: record 1 is not valid sharegpt: .*must end with a gpt turn"):
        load_file_examples(f)
    f = write(tmp_path / "al.json", [{"instruction": "q", "output": "a <result> never closed"}])
    with pytest.raises(ConfigError, match=r"record 0 is not valid alpaca: .*without a closing"):
        load_file_examples(f)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="neither a JSON list nor JSON lines"):
        load_file_examples(tmp_path / "broken.json")
    with pytest.raises(ArpoError, match="SFT data file not found: .*missing.json"):
        load_file_examples(tmp_path / "missing.json")


def test_config_strict_and_validated():
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        SFTConfig.from_dict({"learning_rate": 1e-4})
    with pytest.raises(ConfigError, match="lr must be float"):
        SFTConfig.from_dict({"lr": "fast"})
    with pytest.raises(ConfigError, match="truncation='cut' is not one of 'drop', 'truncate'"):
        SFTConfig.from_dict({"truncation": "cut"})
    with pytest.raises(ConfigError, match="batch_size must be > 0"):
        SFTConfig.from_dict({"batch_size": 0})
    with pytest.raises(ConfigError, match="levels must be list"):
        SFTConfig.from_dict({"levels": [1, "2"]})
    assert SFTConfig.from_dict({"lr": 3, "levels": [1, 2]}).lr == 3


def test_cli_config_layers(tmp_path):
    toml = tmp_path / "sft.toml"
    toml.write_text('model = "m"\nlr = 1e-5\nepochs = 5\n')
    parser = argparse.ArgumentParser()
    register_sft(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "sft",
            "--config",
            str(toml),
            "--set",
            "lr=2e-4",
            "--set",
            "levels=[1, 2]",
            "--set",
            "data=toolmath",
            "--epochs",
            "7",
            "--output",
            str(tmp_path / "o"),
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.model, cfg.lr, cfg.levels, cfg.data, cfg.epochs) == ("m", 2e-4, [1, 2], "toolmath", 7)
    assert cfg.output_dir == str(tmp_path / "o")
    bad = parser.parse_args(["sft", "--config", str(toml), "--set", "epoch=3"])
    with pytest.raises(ConfigError, match="unknown key 'epoch'") as err:
        config_from_args(bad)
    assert err.value.hint == "did you mean 'epochs'?"  # the same hint as every other config (was: all keys)
    dotted = parser.parse_args(["sft", "--set", "sft.lr=1e-5"])  # SFTConfig has no sections
    with pytest.raises(ConfigError, match="no sections, so the form is key=value"):
        config_from_args(dotted)


def test_missing_model_names_pull_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ARPO_HOME", str(tmp_path / "empty-home"))  # a cache where nothing is pulled
    f = write(tmp_path / "d.json", [{"instruction": "q", "output": "a"}])
    with pytest.raises(ArpoError, match="arpo model pull smollm2-135m-instruct"):
        run_sft({"model": "smollm2-135m-instruct", "data": str(f), "output_dir": str(tmp_path / "o")})
    with pytest.raises(ConfigError, match="model is empty"):
        run_sft({"model": "", "data": str(f)})


def test_length_policy(tok):
    rows, counts = build_dataset(tok, [demo(), demo(2, 3, 4)], max_seq_len=10_000, truncation="drop")
    assert counts == {"examples": 2, "dropped_too_long": 0, "truncated": 0, "dropped_no_target": 0, "kept": 2}
    short = min(len(tokenize_example(tok, d)[0]) for d in (demo(), demo(2, 3, 4)))
    rows, counts = build_dataset(tok, [demo(), demo(2, 3, 4)], max_seq_len=short, truncation="drop")
    assert counts["kept"] == 1 and counts["dropped_too_long"] == 1
    rows, counts = build_dataset(tok, [demo(), demo(2, 3, 4)], max_seq_len=short, truncation="truncate")
    assert counts["kept"] == 2 and counts["truncated"] == 1 and max(len(r[0]) for r in rows) == short
    with pytest.raises(ConfigError, match="no SFT example fits max_seq_len=5"):
        build_dataset(tok, [demo()], max_seq_len=5, truncation="drop")


def test_short_sft_lowers_loss_and_saves_hf_folder(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recs = [
        {
            "instruction": f"What is {a} * 3?",
            "output": f"<python>print({a}*3)</python> <result>\n{a * 3}\n</result><answer>\\boxed{{{a * 3}}}</answer>",
            "system": SYSTEM,
        }
        for a in range(8)
    ]
    f = write(tmp_path / "train.json", recs)
    out = tmp_path / "ckpt"
    m = run_sft(
        {
            "model": str(tiny_model_dir),
            "data": str(f),
            "output_dir": str(out),
            "epochs": 15,
            "batch_size": 4,
            "grad_accum": 2,
            "lr": 3e-3,
            "max_seq_len": 512,
            "progress": False,
            "tensorboard": True,
            "log_every": 2,
            "warmup_ratio": 0.0,
        }
    )
    assert m["steps"] == 15 and m["final_loss"] < 0.7 * m["first_loss"], m
    saved = json.loads((out / "sft_metrics.json").read_text())
    assert saved["tokens_trained"] == m["tokens_trained"] > 0 and saved["counts"]["kept"] == 8
    assert list((out / "tb").iterdir())
    from arpo_algo.models.card import read_card

    card = read_card(out)  # an SFT output is a policy folder too: it carries its model card
    assert card["library_name"] == "transformers" and "sft" in card["tags"] and card["arpo"]["data"] == str(f)
    assert (
        card["arpo"]["algorithm"] == "SFT"
        and card["arpo"]["env"] is None
        and len(card["arpo"]["base_fingerprint"]) == 64
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # The saved weights are the trained ones: the loss on the training data is as low as the run reported.
    ex = load_file_examples(f)[0]
    ids, labels = tokenize_example(tok, ex)
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
    assert loss < 0.8 * m["first_loss"]


@pytest.mark.slow
def test_smollm2_learns_python_tool_on_toolmath(tmp_path, smollm2_dir):
    """SFT on ToolMath demos makes SmolLM2 emit a <python> call on a held-out test prompt (greedy)."""
    pytest.importorskip("arpo_env.tasks.toolmath")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arpo_env.demonstrations import toolmath_demonstrations

    t0 = time.time()
    # The quickstart setting: 96 demos, one epoch = 12 optimizer steps (~4 min on 2 idle CPU cores).
    m = run_sft(
        {
            "model": str(smollm2_dir),
            "data": "toolmath",
            "num_examples": 96,
            "epochs": 1,
            "batch_size": 8,
            "lr": 2e-4,
            "output_dir": str(tmp_path / "o"),
            "progress": False,
            "tensorboard": False,
            "max_seq_len": 512,
        }
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    tok = AutoTokenizer.from_pretrained(tmp_path / "o")
    held_out = toolmath_demonstrations(5, seed=123, split="test", levels=[1])
    calls = 0
    for d in held_out:
        enc = tok.apply_chat_template(d["messages"], add_generation_prompt=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=96, do_sample=False, stop_strings=["</python>"], tokenizer=tok)
        text = tok.decode(out[0, enc["input_ids"].shape[1] :])
        calls += "<python>" in text
    print(f"sft {m['time_s']}s, total {time.time() - t0:.0f}s, python calls {calls}/5")
    assert calls >= 4


def test_cli_sft_end_to_end_on_tiny_model(tmp_path, tiny_model_dir, capsys):
    f = write(tmp_path / "d.json", [{"instruction": "q", "output": "<python>1</python><result>1</result>a"}] * 4)
    parser = argparse.ArgumentParser()
    register_sft(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "sft",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(f),
            "--output",
            str(tmp_path / "o"),
            "--max-steps",
            "2",
            "--set",
            "progress=false",
            "--set",
            "tensorboard=false",
            "--set",
            "precision=native",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == str(tmp_path / "o") and (tmp_path / "o" / "config.json").exists()
    saved = json.loads((tmp_path / "o" / "sft_metrics.json").read_text())
    assert saved["steps"] == 2
    from arpo_algo.train.device_setup import cpu_capability

    # "native": bf16 autocast exactly where this CPU multiplies bf16 matrices in hardware
    assert saved["compute"] == {
        "precision": "bf16" if cpu_capability()["native_bf16_matmul"] else "fp32",
        "setting": {"precision": "native"},
        "device": "cpu",
        "cpu": cpu_capability(),
    }


def test_the_old_bf16_switch_is_refused_naming_precision():
    with pytest.raises(ConfigError, match="bf16 is now precision") as err:
        SFTConfig.from_dict({"bf16": True})
    assert 'precision = "bf16"' in err.value.hint
    with pytest.raises(ConfigError, match="precision='half' is not one of"):
        SFTConfig(precision="half").validate()


def test_train_step_loss_and_gradients_equal_the_full_logits_computation(tiny_model_dir):
    """The trained-positions-only LM head (it saves memory) gives the loss and gradients of the full-logits form."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from arpo_algo.train.sft import _collate, _train_step

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = [([5, 6, 7, 8, 9, 10], [-100, -100, 7, 8, -100, 10]), ([11, 12, 13], [-100, 12, 13])]
    loss, n = _train_step(model, [batch], 0, torch.device("cpu"), False)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ids, labels, mask = _collate(batch, 0, torch.device("cpu"))
    logits = model(input_ids=ids, attention_mask=mask).logits
    ref = (
        F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        / n
    )
    ref.backward()
    assert n == 5 and abs(loss - ref.item()) < 1e-5
    for k, p in model.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-6), k


def _loss_and_grads(model, batch, **kw):
    import torch

    from arpo_algo.train.sft import _train_step

    model.zero_grad(set_to_none=True)
    loss, n = _train_step(model, batch, 0, torch.device("cpu"), False, **kw)
    return loss, n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_rows_per_forward_and_gradient_checkpointing_give_the_same_loss_and_gradients(tiny_model_dir):
    """Memory options: passes of fewer rows and activation checkpointing leave the step's loss and
    gradients as they were (rows of different lengths, so the chunks are padded to different widths)."""
    import torch
    from transformers import AutoModelForCausalLM

    from arpo_algo.train.sft import SFTConfig, _load_model

    rows = [
        ([5, 6, 7, 8, 9, 10, 11], [-100, -100, 7, 8, -100, 10, 11]),
        ([11, 12, 13], [-100, 12, 13]),
        ([20, 21, 22, 23, 24], [-100, -100, -100, 23, 24]),
    ]
    micro = [rows[:2], rows[2:]]  # grad_accum 2
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    ref_loss, ref_n, ref = _loss_and_grads(model, micro)
    for rpf in (1, 2):
        loss, n, grads = _loss_and_grads(model, micro, rows_per_forward=rpf)
        assert n == ref_n == 8 and abs(loss - ref_loss) < 1e-6
        for k in ref:
            assert torch.allclose(grads[k], ref[k], atol=1e-6), (rpf, k)
    ckpt, _, _ = _load_model(SFTConfig(model=str(tiny_model_dir), gradient_checkpointing=True, device="cpu"))
    ckpt.train()
    assert ckpt.is_gradient_checkpointing
    for rpf in (None, 1):
        loss, n, grads = _loss_and_grads(ckpt, micro, rows_per_forward=rpf)
        assert n == ref_n and abs(loss - ref_loss) < 1e-6
        for k in ref:
            assert torch.allclose(grads[k], ref[k], atol=1e-6), (rpf, k)


def test_sft_run_with_the_memory_options_trains_like_without(tiny_model_dir, tmp_path):
    """Through run_sft: same steps, same losses (to float rounding) with rows_per_forward + gradient checkpointing."""
    f = tmp_path / "d.jsonl"
    f.write_text(
        "\n".join(
            json.dumps({"instruction": f"What is {i} + {i}?", "input": "", "output": f"The answer is {2 * i}."})
            for i in range(6)
        )
    )
    base = {
        "model": str(tiny_model_dir),
        "data": str(f),
        "epochs": 1,
        "batch_size": 3,
        "grad_accum": 2,
        "lr": 3e-3,
        "progress": False,
        "tensorboard": False,
        "device": "cpu",
    }
    a = run_sft({**base, "output_dir": str(tmp_path / "a")})
    b = run_sft({**base, "output_dir": str(tmp_path / "b"), "rows_per_forward": 2, "gradient_checkpointing": True})
    assert a["steps"] == b["steps"] == 1 and a["tokens_trained"] == b["tokens_trained"]
    assert abs(a["history"][0]["loss"] - b["history"][0]["loss"]) < 1e-6
    assert abs(a["history"][0]["grad_norm"] - b["history"][0]["grad_norm"]) < 1e-5
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg.get("use_cache", True) is True  # the saved folder generates with its KV cache as before


@pytest.mark.parametrize(
    "bad",
    [
        {"rows_per_forward": 0},
        {"rows_per_forward": -2},
        {"rows_per_forward": 1.5},
        {"gradient_checkpointing": "yes"},
        {"rows_per_forward_": 2},
    ],
)
def test_memory_options_are_validated(bad):
    (key,) = bad
    with pytest.raises(ConfigError, match=f"sft config: (unknown key '{key}'|{key} must)"):  # refused for that key
        SFTConfig.from_dict({"model": "m", **bad})


def test_gradient_checkpointing_changes_no_bit_of_the_gradients_at_fixed_rows_per_forward(tiny_model_dir):
    """Checkpointing only recomputes activations, in the same order and shapes: at the same passes the loss and every
    gradient are bit for bit those without it, so the quickstart may take either for memory or speed alone."""
    import torch

    from arpo_algo.train.sft import SFTConfig, _load_model

    rows = [
        ([5, 6, 7, 8, 9, 10, 11], [-100, -100, 7, 8, -100, 10, 11]),
        ([11, 12, 13], [-100, 12, 13]),
        ([20, 21, 22, 23, 24], [-100, -100, -100, 23, 24]),
        ([30, 31, 32, 33], [-100, 31, 32, 33]),
    ]
    got = []
    for ckpt in (False, True):
        model, _, _ = _load_model(SFTConfig(model=str(tiny_model_dir), gradient_checkpointing=ckpt, device="cpu"))
        model.train()
        assert model.is_gradient_checkpointing == ckpt
        got.append(_loss_and_grads(model, [rows], rows_per_forward=2))
    (loss_a, n_a, grads_a), (loss_b, n_b, grads_b) = got
    assert (loss_a, n_a) == (loss_b, n_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
