"""Running the kernels on CPU tensors through the Triton interpreter.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so interpreted kernels come from a
second copy of this package's kernel modules, executed with the variable set
(``interpreted_module``). The copy lives under its own name, ``aegis_kernels._triton_interpreted``,
and its relative imports resolve inside the copy, so an interpreted kernel calls interpreted helpers.

Two things the interpreter does unlike the GPU are emulated in the interpreted copy, so CPU tests
see the GPU's bits: it has no fused multiply-add (``SOFT_FMA``: one rounding through an exact fp64
product, as ``reference.fma``) and it converts fp32 -> bf16 by truncation (``SOFT_BF16``: round to
nearest even by hand). Both switches are constexprs of the module copy they live in.

Interpreted kernels are launched through ``InterpretedLaunch``, which makes Triton's own ``@jit``
helpers (``tl.sum``, ...) callable inside them.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import os
import sys
import threading
from types import ModuleType

import triton.language as tl

# True in a process started with TRITON_INTERPRET=1 (CI), and in the interpreted copy itself.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Emulation switches, read as constexprs by the jit helpers in stream.py (see the module docstring).
SOFT_FMA = tl.constexpr(INTERPRETED)
SOFT_BF16 = tl.constexpr(INTERPRETED)

_PACKAGE = __name__.rpartition(".")[0]  # aegis_kernels.triton (or the copy's name inside the copy)
_COPY = _PACKAGE.rpartition(".")[0] + "._triton_interpreted"
_lock = threading.Lock()


def interpreted_module(name: str) -> ModuleType:
    """``aegis_kernels.triton.<name>`` executed under TRITON_INTERPRET=1: its kernels run on CPU tensors.

    In a process that already interprets, the package's own module is returned."""
    if INTERPRETED:
        return importlib.import_module(f"{_PACKAGE}.{name}")
    with _lock:
        full = f"{_COPY}.{name}"
        mod = sys.modules.get(full)
        if mod is not None:
            return mod
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            if _COPY not in sys.modules:  # an empty package whose submodules load from this directory
                copy = ModuleType(_COPY)
                copy.__path__ = list(sys.modules[_PACKAGE].__path__)
                copy.__package__ = _COPY
                copy.__spec__ = importlib.machinery.ModuleSpec(_COPY, loader=None, is_package=True)
                copy.__spec__.submodule_search_locations = copy.__path__
                sys.modules[_COPY] = copy
            return importlib.import_module(full)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old


class InterpretedLaunch:
    """Runs an interpreted kernel with triton's own @jit helpers (tl.sum, tl.zeros, ...) callable.

    Those were decorated without TRITON_INTERPRET when triton was imported, so inside an
    interpreted kernel they are JITFunctions; for the launch ``JITFunction.__call__`` is patched to
    run them as InterpretedFunctions. The interpreter's integer-overflow sanitizer (a check per
    uint32 cipher addition, where wrapping is the point) is switched off for the launch: it doubles
    the run time.
    """

    _lock = threading.RLock()
    _wrapped: dict = {}

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime import interpreter
            from triton.runtime.jit import JITFunction

            wrapped = InterpretedLaunch._wrapped

            def call(jit_fn, *a, **k):
                fn = wrapped.get(id(jit_fn))  # by id: hashing a JITFunction parses its source
                if fn is None:
                    fn = wrapped[id(jit_fn)] = interpreter.InterpretedFunction(jit_fn.fn)
                return fn(*a, **k)

            builder = interpreter.interpreter_builder
            with InterpretedLaunch._lock:
                saved_call, saved_options = JITFunction.__call__, builder.options
                JITFunction.__call__ = call
                if "sanitize_overflow" in {f.name for f in dataclasses.fields(saved_options)}:
                    builder.options = dataclasses.replace(saved_options, sanitize_overflow=False)
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    JITFunction.__call__ = saved_call
                    builder.options = saved_options

        return launch


class InterpretedKernels:
    """An interpreted kernel module whose kernels launch through InterpretedLaunch."""

    def __init__(self, mod: ModuleType):
        self.mod = mod

    def __getattr__(self, name):
        from triton.runtime.interpreter import InterpretedFunction

        obj = getattr(self.mod, name)
        return InterpretedLaunch(obj) if isinstance(obj, InterpretedFunction) else obj
