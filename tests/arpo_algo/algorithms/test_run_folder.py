"""A bare ``build_algo()`` keeps one run folder, as RLlib's Algorithm does: the one Ray's Trainable makes under
``~/ray_results``, which holds the run's trees (run in a process of its own, with its own home folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys
from arpo_algo.algorithms import ARPOConfig
cfg = (
    ARPOConfig()
    .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
    .training(model_path=sys.argv[1], prompts_per_step=1)
    .tree(budget=2, initial=1)
    .llm_rollouts(max_response_tokens=8, hf={"max_batch_size": 4})
)
algo = cfg.build_algo()
algo.train()
algo.train()
print(json.dumps({"logdir": algo.logdir}))
algo.stop()
"""


def test_bare_build_algo_keeps_one_run_folder(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    logdir = Path(json.loads(out.stdout.strip().splitlines()[-1])["logdir"])
    runs = list((home / "ray_results").iterdir())
    assert runs == [logdir]  # one folder for the run, not one per component
    index = [json.loads(x) for x in (logdir / "trees" / "index.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in index] == [1, 2]
