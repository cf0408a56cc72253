"""The ``arpo`` command line: version, doctor, model list, and how user errors are reported."""

from __future__ import annotations

import json
import subprocess
import sys

from arpo_algo.cli.main import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arpo_algo.cli", *args], capture_output=True, text=True, timeout=300)


def test_version():
    p = run_cli("--version")
    assert p.returncode == 0 and p.stdout.startswith("arpo ")


def test_doctor_reports_truthfully():
    import importlib.metadata as md

    import torch

    p = run_cli("doctor", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["packages"]["torch"] == md.version("torch")
    assert r["packages"]["ray"] == md.version("ray")
    assert r["gpu"]["cuda_available"] == torch.cuda.is_available()
    sandbox = r["python_tool_sandbox"]
    assert set(sandbox) >= {"backend", "network_isolation", "detail"}
    assert any(m["name"] == "smollm2-135m-instruct" for m in r["models"])
    import importlib.util

    assert r["vllm"]["importable"] == (importlib.util.find_spec("vllm") is not None)
    flags = open("/proc/cpuinfo").read().split()
    assert r["vllm"]["cpu"]["avx512f"] == ("avx512f" in flags) and r["vllm"]["cpu"]["amx_bf16"] == ("amx_bf16" in flags)
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert r["cpu_bf16"]["flags_known"] and r["cpu_bf16"]["native_bf16_matmul"] == native
    from arpo_algo.rollout.engines.hf.compiled_step import compiler_problem

    assert r["compiled_decode"] == {"available": compiler_problem() is None, "problem": compiler_problem()}
    human = run_cli("doctor")
    assert "python tool" in human.stdout and "model cache" in human.stdout and "vLLM" in human.stdout
    assert "compiler" in human.stdout
    bf16_line = next(line for line in human.stdout.splitlines() if line.strip().startswith("bf16 matmul"))
    assert bf16_line.split("bf16 matmul", 1)[1].strip().startswith("native" if native else "not native"), bf16_line
    assert "precision 'native' (the quickstart's)" in bf16_line


def test_user_error_is_one_line_and_nonzero(capsys):
    rc = main(["model", "pull", "no-such-model"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.splitlines()[0] == "error: unknown model name 'no-such-model'"
    assert "Traceback" not in err


def test_verbose_shows_traceback(capsys):
    rc = main(["--verbose", "model", "pull", "no-such-model"])
    assert rc == 2
    assert "Traceback" in capsys.readouterr().err


def test_model_list_json():
    p = run_cli("model", "list", "--json")
    assert p.returncode == 0
    assert any(r["name"] == "smollm2-135m-instruct" for r in json.loads(p.stdout))
