"""Build-on-first-use for formwork's small C++ CPU extensions.

torch's `cpp_extension.load_inline` with the machine's compiler and
-march=native; the build is cached by torch under a name keyed by the CPU's
feature flags and the source, so a changed source or another CPU rebuilds.
A failed build returns None and is remembered: callers keep their torch path.
`FORMWORK_CPU_MARCH` (e.g. `x86-64-v3`: AVX2 without AVX-512) builds for another
CPU level than this machine's, so the paths other machines take can be tested here.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading

log = logging.getLogger("formwork.kernels")

_lock = threading.Lock()
_built: dict[str, object] = {}
_failures: dict[str, str] = {}
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(name: str, source: str, functions: list[str], cflags: list[str] | None = None):
    """The compiled module, or None if it cannot be built here (see `failure`).
    `cflags`: instead of CFLAGS (a source that compares NaN or inf leaves out -ffast-math)."""
    with _lock:
        if name in _built:
            return _built[name]
        if name in _failures:
            return None
        flags = CFLAGS if cflags is None else cflags
        march = os.environ.get("FORMWORK_CPU_MARCH")
        if march:
            flags = [f"-march={march}" if f == "-march=native" else f for f in flags]
        tag = hashlib.sha1((_cpu_flags() + " ".join(flags) + source).encode()).hexdigest()[:12]
        try:
            from torch.utils.cpp_extension import load_inline   # pulls in the build tooling
            module = load_inline(name=f"{name}_{tag}", cpp_sources=source, functions=functions,
                                 extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure means: keep the torch path
            _failures[name] = f"{type(e).__name__}: {e}"
            log.warning("C++ extension %s unavailable, using the torch path: %s", name,
                        _failures[name].splitlines()[0][:300])
            return None
        _built[name] = module
        return module


def failure(name: str) -> str | None:
    """Why `name` did not build (None if it built or was never tried)."""
    return _failures.get(name)
