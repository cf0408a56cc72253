"""Teach the tiny random Llama one tool call, so sampler tests see real calls from a real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_algo.rollout import layout


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
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(epochs):  # a mean loss < 1e-3 per call token: the call comes out whole almost always
        for ids, labels in seqs:
            opt.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
