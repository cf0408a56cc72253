"""The front-door tier: every shell command of the README's examples and of the tutorial, run as written, in order.

Each document runs in an empty folder of its own. Two things are substituted, never the commands' text:

* the model: ``$ARPO_HOME`` is a fresh cache in which the name ``smollm2-135m-instruct`` holds the tiny test model as
  a pulled model (``arpo model pull`` finds it there and pulls nothing);
* the budget: ``ARPO_SMOKE=1`` (:mod:`arpo_algo.run.smoke`), the smallest budget of every command.

A fenced block is marked for the tier by the HTML comment on the line before it: ``<!-- docs-test: skip (why) -->``
(not run; the reason is required) or ``<!-- docs-test: server (...) -->`` (a long-running server: started in the
background, ready once it prints its ``serving`` line, used by the blocks after it, stopped at the end). Every
``bash`` or ``python`` block that is not a server runs or is marked skip; a block that fails fails the tier, naming
the document, its line and the command's output.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ("docs/tutorial.md", "README.md")
DIRECTIVE = re.compile(r"^<!-- docs-test: (skip|server) \((.+)\) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")
RUNNABLE = {"bash", "sh", "shell", "console", "python"}
BLOCK_TIMEOUT_S = 600
SERVER_READY_S = 300


@dataclass
class Block:
    document: str
    line: int
    lang: str
    code: str
    mark: str | None  # None (run), "skip" or "server"


def blocks(document: str) -> list[Block]:
    """The fenced blocks of a Markdown document, with the mark on the line before each."""
    lines = (REPO / document).read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, j = i, i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        before = DIRECTIVE.match(lines[start - 1].strip()) if start else None
        found.append(
            Block(
                document,
                start + 1,
                m.group(1).lower(),
                "\n".join(lines[start + 1 : j]),
                before.group(1) if before else None,
            )
        )
        i = j + 1
    return found


def test_the_block_reader_sees_marks_languages_and_lines(tmp_path, monkeypatch):
    """The parser itself (guards against a tier that silently runs nothing)."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n```bash\necho a\n```\n<!-- docs-test: skip (why) -->\n```python\nx = 1\n```\n"
        "<!-- docs-test: server (s) -->\n```bash\nsleep 1\n```\n```text\nfigure\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    got = [(b.line, b.lang, b.code, b.mark) for b in blocks("doc.md")]
    assert got == [
        (2, "bash", "echo a", None),
        (6, "python", "x = 1", "skip"),
        (10, "bash", "sleep 1", "server"),
        (13, "text", "figure", None),
    ]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_runnable_block_runs_or_says_why_not(document):
    bad = [
        f"{document}:{b.line} ({b.lang})"
        for b in blocks(document)
        if b.lang in RUNNABLE and b.mark is None and b.lang not in ("bash", "sh", "shell", "console")
    ]
    assert not bad, f"blocks that are neither run by the tier nor marked '<!-- docs-test: skip (why) -->': {bad}"
    assert [b for b in blocks(document) if b.lang in RUNNABLE and b.mark != "skip"], "the tier would run nothing"


def _environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARPO_")}
    env.update(
        ARPO_HOME=str(home),
        ARPO_SMOKE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        PATH=os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    )
    return env


def _home_with_the_tiny_model(home: Path, tiny_model_dir: Path) -> None:
    """A model cache in which the quickstart's model name is the tiny test model, as ``arpo model pull`` leaves one."""
    from arpo_algo.models.store import COMPLETE_MARKER

    target = home / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_model_dir, target)
    (target / COMPLETE_MARKER).write_text("the tiny test model, placed by the front-door tier\n")


class Server:
    """A server block's process: started in its own session, ready when it prints ``serving``, stopped as a group."""

    def __init__(self, block: Block, cwd: Path, env: dict[str, str]) -> None:
        self.block, self.output, self.ready = block, [], threading.Event()
        self.proc = subprocess.Popen(
            ["bash", "-c", f"exec {block.code.strip()}"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("serving "):
                self.ready.set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_READY_S
        while time.monotonic() < deadline and self.proc.poll() is None and not self.ready.is_set():
            self.ready.wait(1)
        if not self.ready.is_set():
            self.stop()
            pytest.fail(
                f"{self.block.document}:{self.block.line}: the server did not become ready "
                f"(exit {self.proc.returncode}):\n{''.join(self.output)[-4000:]}",
                pytrace=False,
            )

    def stop(self) -> None:
        """Ctrl-C, as a user would; then the whole process group (Ray's processes included) by force."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_documents_commands_run_as_written(document, tiny_model_dir, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    _home_with_the_tiny_model(home, tiny_model_dir)
    env = _environment(home)
    servers: list[Server] = []
    ran = []
    try:
        for block in blocks(document):
            if block.lang not in ("bash", "sh", "shell", "console") or block.mark == "skip":
                continue
            if block.mark == "server":
                servers.append(Server(block, work, env))
                servers[-1].wait_ready()
                ran.append(block.code)
                continue
            t0 = time.monotonic()
            proc = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", block.code],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT_S,
            )
            print(f"{document}:{block.line}: {time.monotonic() - t0:.1f} s")
            if proc.returncode != 0:
                pytest.fail(
                    f"{document}:{block.line}: exit {proc.returncode}\n$ {block.code}\n"
                    f"{(proc.stdout + proc.stderr)[-4000:]}",
                    pytrace=False,
                )
            ran.append(block.code)
    finally:
        for server in servers:
            server.stop()
    assert ran, f"{document}: no command ran"
