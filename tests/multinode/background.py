"""Commands run beside a multinode test (a sweep, a run, a server) while the test acts on the cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


class Background:
    """A command run beside the test with its output in a file, never a pipe: a pipe the test does not drain fills
    up and blocks the command at its next write (a sweep's driver printing progress would stall the whole sweep)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path):
        self.log = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float, what: str) -> str:
        """The whole output once the command has exited; a failure naming ``what`` it waited for if it has not
        exited within ``timeout`` seconds (the command is killed)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{what}: still running after {timeout:.0f}s\n{self.output()[-5000:]}")
        return self.output()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
