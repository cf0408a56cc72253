"""The test run's own ARPO_HOME (tests/conftest.py) is gone when the run ends; a persistent one is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import os
from pathlib import Path

def test_home_is_usable():
    home = Path(os.environ["ARPO_HOME"])
    (home / "models").mkdir(parents=True, exist_ok=True)
    (home / "models" / "weights.bin").write_bytes(b"0" * 1024)
    print("HOME=" + str(home))
"""


def _run(tmp_path: Path, env: dict[str, str]) -> str:
    probe = REPO / "tests" / f"test_probe_home_{os.getpid()}.py"  # inside tests/ so that conftest.py applies
    probe.write_text(PROBE)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(probe)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        probe.unlink()
    assert out.returncode == 0, out.stdout + out.stderr
    return next(line[5:] for line in out.stdout.splitlines() if line.startswith("HOME="))


def test_a_run_removes_the_home_it_made(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ARPO_TEST_HOME", "ARPO_HOME")} | {"TMPDIR": str(tmp_path)}
    home = Path(_run(tmp_path, env))
    assert home.parent == tmp_path and home.name.startswith("arpo-test-home-")
    assert not home.exists()


def test_a_named_home_is_kept(tmp_path):
    keep = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "ARPO_HOME"} | {"ARPO_TEST_HOME": str(keep)}
    assert Path(_run(tmp_path, env)) == keep
    assert (keep / "models" / "weights.bin").stat().st_size == 1024
