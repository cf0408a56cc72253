"""The GPU image, the cluster configuration, the GPU recipes and their estimator, checked on CPU.

The image itself cannot be built here (no Docker daemon) and no GPU run is made: these tests keep the files honest
(pins agree with pyproject.toml, the build context excludes runs and weights, every recipe loads and validates, the
estimator's arithmetic follows from its stated inputs).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
GPU_RECIPES = sorted((REPO / "experiments" / "gpu").glob("gpu_*.toml"))


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirement(lines: list[str], name: str) -> Requirement:
    found = [Requirement(x) for x in lines if Requirement(x).name == name]
    assert len(found) == 1, f"expected one {name} line, got {found}"
    return found[0]


def _docker_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.M))


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_pins_agree_with_pyproject():
    args, project = _docker_args(), _pyproject()["project"]
    torch = _requirement(project["dependencies"], "torch")
    vllm = _requirement(project["optional-dependencies"]["vllm"], "vllm")
    assert torch.specifier.contains(args["TORCH_VERSION"]), (args["TORCH_VERSION"], str(torch))
    assert vllm.specifier.contains(args["VLLM_VERSION"]), (args["VLLM_VERSION"], str(vllm))
    major, minor = args["CUDA_VERSION"].split(".")[:2]  # the torch wheel index names the CUDA line: cu130 for 13.0
    assert args["TORCH_INDEX"].rstrip("/").endswith(f"/cu{major}{minor}"), (args["TORCH_INDEX"], args["CUDA_VERSION"])
    runs = " ".join(a for i, a in _instructions() if i == "RUN")
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in runs
    assert '"vllm==${VLLM_VERSION}"' in runs


def test_dockerfile_installs_arpo_with_gpu_extras_as_a_non_root_user_and_bakes_no_model():
    ins = _instructions()
    extras = set(_pyproject()["project"]["optional-dependencies"])
    installs = re.findall(r"/opt/arpo-src\[([\w,-]+)\]", " ".join(a for i, a in ins if i == "RUN"))
    assert installs and set(installs[0].split(",")) == {"vllm", "deepspeed"} <= extras
    assert ins[0][0] == "ARG" and any(i == "FROM" and "nvidia/cuda:" in a for i, a in ins)
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1] not in ("root", "0")
    env = " ".join(a for i, a in ins if i == "ENV")
    home = re.search(r"ARPO_HOME=(\S+)", env).group(1)
    assert any(i == "VOLUME" and home in a for i, a in ins)
    for src in (s for i, a in ins if i == "COPY" for s in a.split()[:-1]):
        assert (REPO / src).exists(), f"COPY source {src} missing from the checkout"
    runs = " ".join(a for i, a in ins if i == "RUN").lower()
    for baked in ("model pull", "data pull", "snapshot_download", "huggingface-cli", "hf download", "wget", "curl"):
        assert baked not in runs, f"the image must not fetch models or data at build time ({baked!r})"


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is excluded when a pattern matches it or one of its parent folders (no negations)."""

    def regex(p: str) -> re.Pattern:
        out = re.escape(p).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        return re.compile(out.replace(r"\?", "[^/]") + "$")

    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(regex(p).match(prefix) for p in patterns for prefix in prefixes)


def test_dockerignore_keeps_runs_caches_venvs_and_weights_out_but_not_the_code():
    patterns = [
        x.strip() for x in (REPO / ".dockerignore").read_text().splitlines() if x.strip() and not x.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns)
    for path in (
        "runs/quickstart/metrics.jsonl",
        ".venv/bin/python",
        ".venv-vllm/lib/x.py",
        "tune_results/a/b",
        "arpo_algo/__pycache__/x.pyc",
        "weights/model.safetensors",
        "x/model.gguf",
        ".git/HEAD",
        ".arpo/models/smollm2/model.safetensors",
        "data/train.parquet",
        "models/Qwen3-8B/config.json",
        ".pytest_cache/v",
        ".ruff_cache/x",
    ):
        assert _dockerignored(path, patterns), path
    for path in (
        "pyproject.toml",
        "README.md",
        "arpo_algo/models/store.py",
        "arpo_env/data.py",
        "experiments/gpu/gpu_reasoning_qwen25_7b.toml",
        "scripts/quickstart",
        "serve/__init__.py",
    ):
        assert not _dockerignored(path, patterns), path


def test_cluster_config_uses_the_image_and_names_every_placeholder():
    text = (REPO / "docker" / "cluster.yaml").read_text()
    cfg = yaml.safe_load(text)
    tag = re.search(r"-t (\S+) \.", DOCKERFILE.read_text()).group(1)  # the documented build tag
    assert cfg["docker"]["image"].endswith("/" + tag)
    assert cfg["provider"]["type"] == "local" and cfg["provider"]["head_ip"]
    assert len(cfg["provider"]["worker_ips"]) == cfg["min_workers"] == cfg["max_workers"] >= 1
    home = re.search(r"ARPO_HOME=(\S+)", DOCKERFILE.read_text()).group(1)
    assert any(o.endswith(":" + home) for o in cfg["docker"]["run_options"])
    body = "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#"))
    header = "\n".join(x for x in text.splitlines() if x.lstrip().startswith("#"))
    used = set(re.findall(r"FILL_ME_[A-Z_]+", body))
    assert used and all(re.sub(r"_\d+$", "_n", u) in header or u in header for u in used)
    assert "ray job submit" in header and "arpo train" in header
    assert any("--dashboard-host=127.0.0.1" in c for c in cfg["head_start_ray_commands"])


# ------------------------------------------------------------------------------------------ GPU recipes


def test_there_are_gpu_recipes_for_both_reference_runs():
    assert [p.stem for p in GPU_RECIPES] == ["gpu_deepsearch_qwen3_8b", "gpu_reasoning_qwen25_7b"]


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_gpu_recipe_loads_validates_and_keeps_the_reference_settings(path):
    from arpo_algo.run.experiment import load_experiment

    exp = load_experiment(path)
    exp.config.validate()
    s = exp.config.settings
    tree, training, rollouts = s.tree, s.training, s.rollouts
    assert (tree.budget, tree.initial, training.prompts_per_step, training.lr) == (16, 8, 128, 1e-6)  # M, N, batch, lr
    # the reference's step count: mini-batches of 16 prompts, 8 optimizer steps per iteration, on a schedule that
    # spans them all
    assert (training.mini_batches, training.ppo_epochs) == (8, 1)
    assert training.schedule_steps == exp.run.iterations * 8
    assert (rollouts.engine, rollouts.device, rollouts.dtype) == ("vllm", "cuda", "bfloat16")
    assert tree.entropy_method == "topk_sum_lnV"
    assert tree.decision_rule == "reference" and training.gradient_checkpointing
    # the longest trajectory (reference prompt + response budget) fits one micro-batch
    prompt = 1536 if "reasoning" in path.stem else 2000
    assert training.micro_batch_tokens >= prompt + rollouts.max_response_tokens
    assert Path(s.model.path).name in ("Qwen2.5-7B-Instruct", "Qwen3-8B")


# ------------------------------------------------------------------------------------------ the estimator


def test_parameter_formula_matches_real_models():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from arpo_algo.run.estimate_gpu import parameters

    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=300,
    )
    for cfg in (
        Qwen2Config(**common, tie_word_embeddings=False),
        Qwen3Config(**common, head_dim=24),
        LlamaConfig(**common, tie_word_embeddings=True),
    ):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        assert parameters(cfg.to_dict()) == sum(p.numel() for p in model.parameters()), type(cfg).__name__


def test_activation_fit_reproduces_the_measured_figures():
    from arpo_algo.run import estimate_gpu as est

    a, b = est.activation_fit()
    assert a > 0 and b > 0
    for layers, hidden, vocab, dup, dedup in est.MEASURED_PEAKS.values():
        slope = (a * layers * hidden + b * vocab) * (est.MICRO_TOKENS_DUP - est.MICRO_TOKENS_DEDUP) / est.GB
        assert slope == pytest.approx(dup - dedup, rel=1e-9)


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_estimator_runs_on_every_gpu_recipe(path, tmp_path, capsys):
    from arpo_algo.run import estimate_gpu as est

    out = tmp_path / "estimate.json"
    r = est.main([str(path), "--gpus", "8", "--zero", "3", "--json", str(out)])
    assert "ESTIMATE (not a measurement)" in capsys.readouterr().out
    assert json.loads(out.read_text())["recipe"] == r["recipe"]
    assert 7.5 < r["parameters_billion"] < 8.3
    m = r["memory_gb_per_gpu"]
    p = r["parameters_billion"] * 1e9
    assert m["weights_fp32"] + m["grads_fp32"] + m["adam_fp32"] == pytest.approx(16 * p / 8 / est.GB)  # ZeRO-3 / 8
    assert r["step_time_s"]["total"] == pytest.approx(r["step_time_s"]["rollout_decode"] + r["step_time_s"]["learner"])
    assert all(v["source"] for v in r["inputs"].values())
    one = est.estimate(str(path), gpus=1, zero=0)  # a 7-8B model's fp32 state alone is over 120 GB: no single GPU
    assert not one["fits"]["learner_alone"] and one["memory_gb_per_gpu"]["learner_total"] > 120


def test_estimator_rejects_a_model_it_cannot_size(tmp_path):
    from arpo_algo.run.estimate_gpu import estimate
    from arpo_base.errors import ConfigError

    with pytest.raises(ConfigError, match="no architecture") as err:
        estimate(str(GPU_RECIPES[0]), gpus=8, zero=3, model_path=str(tmp_path / "nope"))
    assert "model.path" in err.value.hint


def test_the_image_copies_every_package_the_wheel_installs():
    """Bug: the image copied arpo_env, arpo_algo and serve but not arpo_base, so its non-editable install of arpo
    could not import anything. Every top-level package pyproject.toml installs has its COPY line."""
    packages = [name.rstrip("*") for name in _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = re.findall(r"^COPY (\w+) /opt/arpo-src/\1$", DOCKERFILE.read_text(), flags=re.M)
    assert packages and sorted(packages) == sorted(set(packages) & set(copied)), (packages, copied)
