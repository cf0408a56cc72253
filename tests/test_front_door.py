"""The docs tier: every shell and Python block of the README and of every page under ``docs/``, run as written.

Each document runs in a folder of its own: the README and the tutorial in an empty one (they say so); every other
page in a folder that looks like the checkout (links to its tracked top-level folders, so ``experiments/...``,
``examples/...`` and ``scripts/...`` resolve) while everything a block writes, ``runs/`` included, stays in that
folder. Two things are substituted, never the blocks' text:

* the model: ``$ARPO_HOME`` is a fresh cache in which the name ``smollm2-135m-instruct`` holds a tiny test model as
  a pulled model (``arpo model pull`` finds it there and pulls nothing); a page whose blocks run vLLM gets one with
  64-dimensional heads, which vLLM's CPU kernels take. The two caches serve every document. A page's
  folder also holds the SFT checkpoints the pages start from (``runs/sft``, ``runs/quickstart/sft``: what ``arpo sft``
  and the quickstart's SFT stage leave) as the tiny model;
* the budget: ``ARPO_SMOKE=1`` (:mod:`arpo_algo.run.smoke`), the smallest budget of every command.

A ``bash``/``sh`` block runs with ``bash -e -o pipefail``, a ``python`` block as a script on stdin, both in the
document's folder with the same environment; later blocks see what earlier ones wrote. The HTML comment on the line
before a fence marks it for the tier:

* ``<!-- docs-test: skip (KIND: detail) -->``: not run, for one of three reasons only (:data:`SKIP_KINDS`): it needs
  a GPU, it needs several machines, or it runs for more than 2 minutes even under ``ARPO_SMOKE=1`` (the detail then
  says what takes that long). Any other reason fails the tier; each skipped block is reported as a skipped test with
  its reason (``pytest -rs``);
* ``<!-- docs-test: server (...) -->``: a long-running server, started in the background, ready once it prints its
  ready line (:data:`READY`), used by the blocks after it, stopped (Ctrl-C) at the next server block or at the end
  of the document;
* ``<!-- docs-test: file (NAME) -->``: the block is a file the prose asks for (a TOML, a corpus); the tier writes it
  to ``NAME`` in the document's folder, for the blocks after it.

A block that fails fails the tier, naming the document, its line and the block's output.
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
#: The documents that promise their commands run from an empty folder; every other page runs in a checkout-like one.
EMPTY_FOLDER = ("README.md", "docs/tutorial.md")
#: The pages whose blocks together run longest (each starts servers or several training runs): the slow tier
#: (``-m slow``). Every other page runs in the default suite, so CI runs its blocks. The seconds are one page's run
#: of the tier on 2 busy CPUs; a page that grows past about 45 s of that kind belongs here, and one that shrinks
#: below it belongs back in the default suite.
SLOW_PAGES = {
    "docs/howto/lora.md": 482,
    "docs/howto/serving.md": 451,
    "docs/howto/experiments.md": 150,
    "docs/howto/view-trees.md": 139,
    "docs/results/mismatch-alarm.md": 102,
    "docs/howto/evaluation.md": 95,
    "docs/howto/sweeps.md": 50,
    "docs/results/memory.md": 45,
}
DIRECTIVE = re.compile(r"^<!-- docs-test: (skip|server|file) \((.+)\) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")
SHELL = {"bash", "sh", "shell", "console"}
RUNNABLE = SHELL | {"python"}
#: The only reasons a block may go unrun: the tier runs on a CPU-only, single machine, within minutes.
SKIP_KINDS = ("gpu", "multinode", "over 2 min under ARPO_SMOKE")
SKIP_REASON = re.compile(r"^(gpu|multinode|over 2 min under ARPO_SMOKE)(?:: (.+))?$")
#: The checkout's entries a page's folder links to (its commands name them relative to the checkout's root).
CHECKOUT_ENTRIES = ("benchmarks", "docker", "examples", "experiments", "scripts", "serve", "studies", "tests")
#: The SFT checkpoints the pages start from, placed (as the tiny model) in every page's folder.
STARTING_POINTS = ("runs/sft", "runs/quickstart/sft")
#: A server's line saying it is ready: ``arpo serve``'s, ``arpo view``'s, TensorBoard's.
READY = re.compile(r"^(serving|viewing) |^TensorBoard \S+ at http")
#: Ray Serve's own ``serve run``: ready when it logs the application ready (``arpo serve`` logs that line too, before
#: its agents load, so only a ``serve run`` block waits for it).
SERVE_RUN_READY = re.compile(r"Application '[\w-]+' is ready at http")
BLOCK_TIMEOUT_S = 600
SERVER_READY_S = 300
#: A server mark may say where the server answers once ready: ``<!-- docs-test: server (ready at URL) -->``.
READY_AT = re.compile(r"ready at (http://127\.0\.0\.1:\d+/\S*)")


def documents() -> list[str]:
    """The README and every Markdown page under ``docs/``, sorted."""
    return ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))]


def skip_reason_error(reason: str) -> str | None:
    """Why a skip mark's reason is not allowed (``None`` when it is one of :data:`SKIP_KINDS`)."""
    m = SKIP_REASON.match(reason)
    if not m:
        return f"the reason {reason!r} is none of {SKIP_KINDS} (optionally followed by ': detail')"
    if m.group(1).startswith("over") and not m.group(2):
        return f"the reason {reason!r} must say what runs that long (e.g. ': 10 training runs, measured 9 min')"
    return None


@dataclass
class Block:
    document: str
    line: int
    lang: str
    code: str
    mark: str | None  # None (run), "skip", "server" or "file"
    why: str = ""  # the mark's parenthesis: the skip reason, or the file's name


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
                before.group(2) if before else "",
            )
        )
        i = j + 1
    return found


def _runs(document: str) -> bool:
    return any(b.lang in RUNNABLE and b.mark != "skip" for b in blocks(document))


def _skipped() -> list[Block]:
    return [b for d in documents() for b in blocks(d) if b.mark == "skip"]


def test_the_block_reader_sees_marks_languages_and_lines(tmp_path, monkeypatch):
    """The parser itself (guards against a tier that silently runs nothing)."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n```bash\necho a\n```\n<!-- docs-test: skip (gpu) -->\n```python\nx = 1\n```\n"
        "<!-- docs-test: server (s) -->\n```bash\nsleep 1\n```\n```text\nfigure\n```\n"
        "<!-- docs-test: file (a.toml) -->\n```toml\nx = 1\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    got = [(b.line, b.lang, b.code, b.mark, b.why) for b in blocks("doc.md")]
    assert got == [
        (2, "bash", "echo a", None, ""),
        (6, "python", "x = 1", "skip", "gpu"),
        (10, "bash", "sleep 1", "server", "s"),
        (13, "text", "figure", None, ""),
        (17, "toml", "x = 1", "file", "a.toml"),
    ]


def test_a_skip_reason_is_one_of_three_kinds():
    """The vocabulary itself: a GPU, several machines, or more than 2 minutes under smoke (saying what runs)."""
    for allowed in ("gpu", "gpu: vLLM on CUDA", "multinode", "multinode: a head and two workers"):
        assert skip_reason_error(allowed) is None, allowed
    assert skip_reason_error("over 2 min under ARPO_SMOKE: 30 training runs, measured 12 min") is None
    for refused in ("why", "slow", "over 2 min under ARPO_SMOKE", "needs docker", "GPU", "gpu:", "Python, not shell"):
        assert skip_reason_error(refused), refused


def test_every_block_runs_or_skips_for_an_allowed_reason():
    """Every mark is well formed; a skip gives one of the allowed reasons; a file mark names a plain file."""
    bad = []
    for b in (b for d in documents() for b in blocks(d)):
        if b.mark == "skip" and (err := skip_reason_error(b.why)):
            bad.append(f"{b.document}:{b.line}: {err}")
        if b.mark == "file" and (b.lang in RUNNABLE or "/" in b.why or b.why.startswith(".")):
            bad.append(f"{b.document}:{b.line}: a file mark names a plain file of a non-runnable block, not {b.why!r}")
        if b.mark == "server" and b.lang not in SHELL:
            bad.append(f"{b.document}:{b.line}: a server is a shell block")
    assert not bad, "\n".join(bad)
    lines = [ln for d in documents() for ln in (REPO / d).read_text(encoding="utf-8").splitlines()]
    stray = [ln for ln in lines if ln.strip().startswith("<!-- docs-test") and not DIRECTIVE.match(ln.strip())]
    assert not stray, f"malformed docs-test marks: {stray}"
    assert [d for d in documents() if _runs(d)], "the tier would run nothing"


def test_every_slow_page_is_a_page_with_blocks_to_run():
    """A renamed or emptied page cannot linger in :data:`SLOW_PAGES`, naming a page the slow tier no longer runs."""
    assert not [p for p in SLOW_PAGES if not (REPO / p).is_file() or not _runs(p)]


def test_a_block_that_runs_past_its_limit_leaves_nothing_running(tmp_path):
    """A server run in an unmarked block used to outlive its block's timeout and hold its port for the next page."""
    import psutil

    code = f"sleep 300 > /dev/null 2>&1 &\necho $! > {tmp_path}/child\necho started\nsleep 300"
    status, output = run_block(code, "bash", tmp_path, dict(os.environ), timeout=2)
    assert status is None and "started" in output
    child = int((tmp_path / "child").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    # a block that ends on its own leaves nothing behind either, and its status and output come back
    status, output = run_block(
        f"sleep 300 > /dev/null 2>&1 &\necho $! > {tmp_path}/child\necho done",
        "bash",
        tmp_path,
        dict(os.environ),
        timeout=30,
    )
    assert (status, output) == (0, "done\n")
    assert not psutil.pid_exists(int((tmp_path / "child").read_text()))
    assert run_block("import sys; sys.exit(3)", "python", tmp_path, dict(os.environ), timeout=30)[0] == 3


@pytest.mark.parametrize("block", _skipped(), ids=lambda b: f"{b.document}:{b.line}")
def test_skipped_block(block):
    """One skipped test per skipped block, so ``pytest -rs`` lists each with its reason."""
    pytest.skip(f"{block.document}:{block.line} ({block.lang}) not run: {block.why}")


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
    (target / COMPLETE_MARKER).write_text("the tiny test model, placed by the docs tier\n")


@pytest.fixture(scope="module")
def docs_homes(tiny_model_dir, tmp_path_factory) -> dict[bool, Path]:
    """Two model caches, each placed once: the tests' tiny model, and for pages that run vLLM one with 64-dimensional
    heads (hidden size 256), since vLLM's CPU attention kernels refuse the tiny model's 16-dimensional ones."""
    from arpo_algo.models import build_tiny_model

    homes = {}
    for vllm, hidden in ((False, None), (True, 256)):
        tiny = tiny_model_dir
        if hidden:
            tiny = build_tiny_model(tmp_path_factory.mktemp("docs-tiny") / "model", hidden_size=hidden, seed=0)
        homes[vllm] = tmp_path_factory.mktemp("docs") / "home"
        _home_with_the_tiny_model(homes[vllm], tiny)
    return homes


def _folder(document: str, work: Path, home: Path) -> None:
    work.mkdir()
    if document not in EMPTY_FOLDER:
        for name in CHECKOUT_ENTRIES:
            (work / name).symlink_to(REPO / name, target_is_directory=True)
        for start in STARTING_POINTS:
            shutil.copytree(home / "models" / "smollm2-135m-instruct", work / start)


def _answers(url: str) -> bool:
    """Whether ``url`` answers 200 (a health route: 200 only once the server is ready to serve)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:  # refused, reset, or an HTTPError status (a 503 while the agents load)
        return False


class Server:
    """A server block's process: started in its own session, ready when it prints its :data:`READY` line, stopped as a
    group."""

    def __init__(self, block: Block, cwd: Path, env: dict[str, str]) -> None:
        self.block, self.output, self.ready = block, [], threading.Event()
        self.ready_line = SERVE_RUN_READY if re.search(r"(^|\s)serve run ", block.code) else READY
        at = READY_AT.search(block.why)  # a server that prints no ready line is ready once this URL answers
        self.url = at.group(1) if at else None
        self.proc = subprocess.Popen(
            ["bash", "-c", block.code.strip()],
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
            if self.ready_line.search(line):
                self.ready.set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_READY_S
        while time.monotonic() < deadline and self.proc.poll() is None and not self.ready.is_set():
            self.ready.wait(1)
            if self.url and _answers(self.url):
                self.ready.set()
        if not self.ready.is_set():
            self.stop()
            pytest.fail(
                f"{self.block.document}:{self.block.line}: the server did not become ready "
                f"(exit {self.proc.returncode}):\n{''.join(self.output)[-4000:]}",
                pytrace=False,
            )

    def stop(self) -> None:
        """Ctrl-C, as a user would; then by force every process of the server's session: Ray's actors run in process
        groups of their own, and one left behind (Serve's proxy) keeps the port the next server needs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        kill_session(self.proc)


def kill_session(proc: subprocess.Popen) -> None:
    """Kill every process still in the session ``proc`` leads (it was started with ``start_new_session``), then
    ``proc``: whatever a block started, in the background or in process groups of its own, ends with the block, so
    no server outlives its test to hold a port the next document needs."""
    import psutil

    session = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                session.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    for p in session:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(session, timeout=30)
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def run_block(block_code: str, lang: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run one block in a session of its own and return (exit status, output); the status is None when the block
    ran past ``timeout``. Either way nothing the block started is left running."""
    command = [sys.executable, "-"] if lang == "python" else ["bash", "-e", "-o", "pipefail", "-s"]
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(block_code + "\n", timeout=timeout)
        status: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        status = None
    kill_session(proc)
    if status is None:
        # with every writer gone the pipe ends; communicate keeps what it read before the timeout
        output, _ = proc.communicate()
    return status, output


@pytest.mark.parametrize(
    "document",
    [pytest.param(d, marks=pytest.mark.slow) if d in SLOW_PAGES else d for d in documents() if _runs(d)],
)
def test_the_documents_blocks_run_as_written(document, docs_homes, tmp_path):
    docs_home = docs_homes[any("vllm" in b.code for b in blocks(document) if b.lang in RUNNABLE and b.mark != "skip")]
    work = tmp_path / "work"
    _folder(document, work, docs_home)
    env = _environment(docs_home)
    servers: list[Server] = []
    ran = []
    try:
        for block in blocks(document):
            if block.mark == "file":
                (work / block.why).write_text(block.code + "\n", encoding="utf-8")
                continue
            if block.lang not in RUNNABLE:
                continue
            if block.mark == "skip":
                print(f"{document}:{block.line}: skipped ({block.why})")
                continue
            if block.mark == "server":
                for server in servers:  # one server at a time: several listen on the same port
                    server.stop()
                servers.append(Server(block, work, env))
                servers[-1].wait_ready()
                ran.append(block.code)
                continue
            t0 = time.monotonic()
            status, output = run_block(block.code, block.lang, work, env, BLOCK_TIMEOUT_S)
            print(f"{document}:{block.line}: {time.monotonic() - t0:.1f} s")
            if status != 0:
                what = f"exit {status}" if status is not None else f"still running after {BLOCK_TIMEOUT_S} s"
                hint = "" if status is not None else " (a server belongs in a block marked docs-test: server)"
                pytest.fail(
                    f"{document}:{block.line}: {what}{hint}\n{block.code}\n{output[-4000:]}",
                    pytrace=False,
                )
            ran.append(block.code)
    finally:
        for server in servers:
            server.stop()
    assert ran, f"{document}: no block ran"
