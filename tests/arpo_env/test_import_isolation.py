"""arpo_env imports and builds an env without torch, Ray or vLLM (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import sys, gymnasium as gym, arpo_env
import arpo_env.core, arpo_env.rewards, arpo_env.check, arpo_env.data, arpo_env.tasks.reference
import arpo_base.errors, arpo_base.options, arpo_base.paths
env = gym.make("arpo/ToolMath-v0")
env.reset(seed=0)
env.step("<python>print(1)</python>")
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "vllm", "transformers"))
print("BAD", bad)
"""


def test_no_heavy_imports():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "BAD []" in out.stdout, out.stdout
