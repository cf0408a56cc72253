"""Teach the tiny random Llama one tool call, so sampler tests see real calls from a real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_algo.rollout import layout

#: Models taught in this process, by (model folder, epochs, training sequences): teaching is deterministic (seeded
#: AdamW on fixed sequences), so test modules that ask for the same lesson share one folder instead of re-teaching.
_TAUGHT: dict[tuple[Any, ...], Path] = {}


def teach_call(model_dir: Path, out: Path, env: Any, call_text: str, turns: int, epochs: int = 100) -> Path:
    """Save into ``out`` the model of ``model_dir`` taught, in teacher-forced steps, to write ``call_text`` at every
    turn of ToolMath tasks 0-2 played in ``env`` (loss on the call tokens only; at most ``turns`` calls per task)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    call, seqs = tok(call_text, add_special_tokens=False)["input_ids"], []
    for task in range(3):
        _, info = env.reset(options={"task_index": task})
        ids = layout.prompt_ids(tok, info["messages"])
        labels = [-100] * len(ids)
        for _ in range(turns):
            ids, labels = ids + call, labels + call
            obs, _r, terminated, truncated, _i = env.step(call_text)
            if terminated or truncated:
                break
            o = layout.observation_ids(tok, obs)
            ids, labels = ids + o, labels + [-100] * len(o)
        seqs.append((torch.tensor([ids]), torch.tensor([labels])))
    key = (str(model_dir), epochs, tuple(tuple(ids[0].tolist() + labels[0].tolist()) for ids, labels in seqs))
    if key in _TAUGHT and _TAUGHT[key].is_dir():  # the same lesson on the same model: the same weights, taught once
        return _TAUGHT[key]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(epochs):  # a mean loss < 1e-3 per call token: the call comes out whole almost always
        for ids, labels in seqs:
            opt.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _TAUGHT[key] = out
    return out


#: The call every turn of :func:`caller_dir`'s model writes.
CALL = "<python>print(6*7)</python>"


@pytest.fixture(scope="module")
def env_creator(tmp_path_factory: Any) -> Any:
    """ToolMath with the python tool and a tool cache of the module's own."""
    from arpo_env.core import ToolTextEnv

    tools = {"python": {}, "cache": {"path": str(tmp_path_factory.mktemp("tools") / "c.sqlite")}}
    return lambda: ToolTextEnv(task="toolmath", tools=tools)


@pytest.fixture(scope="module")
def caller_dir(tiny_model_dir: Path, tmp_path_factory: Any, env_creator: Any) -> Path:
    """The tiny model taught to write CALL at every turn (loss on the call tokens only), so every turn ends in a tool
    result: a branch candidate. Import it with ``env_creator`` into a test module to use it."""
    return teach_call(tiny_model_dir, tmp_path_factory.mktemp("caller"), env_creator(), CALL, turns=6)
