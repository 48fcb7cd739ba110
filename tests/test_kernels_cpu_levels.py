"""The C++ CPU kernels as a machine without AVX-512 builds them.

This box has AVX-512 (and AVX512-BF16), so `-march=native` compiles only the
kernels' fastest paths; a CI runner or a user's laptop with AVX2 alone takes the
others (`#if defined(__AVX512F__)` ... `#elif defined(__AVX2__)` ... generic).
`FORMWORK_CPU_MARCH=x86-64-v3` builds them for that level here, and the three
kernel suites run again in a fresh process against their torch references
(each suite asserts its extension built: a fallback to torch would fail)."""
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


def _has_avx2() -> bool:
    try:
        return re.search(r"\bavx2\b", Path("/proc/cpuinfo").read_text()) is not None
    except OSError:
        return False


def test_march_override_reaches_the_compiler(monkeypatch):
    """What the suite below relies on: the variable replaces -march=native (and
    only that flag) and gives the build its own cache name."""
    import torch.utils.cpp_extension as ext

    from formwork.kernels import cpu_ext
    seen = []
    monkeypatch.setattr(ext, "load_inline", lambda **kw: seen.append(kw) or object())
    monkeypatch.setattr(cpu_ext, "_built", {})
    cpu_ext.build("probe", "int f() { return 1; }", ["f"])
    monkeypatch.setattr(cpu_ext, "_built", {})
    monkeypatch.setenv("FORMWORK_CPU_MARCH", "x86-64-v3")
    cpu_ext.build("probe", "int f() { return 1; }", ["f"])
    native, v3 = seen
    assert "-march=native" in native["extra_cflags"]
    assert v3["extra_cflags"] == [f if f != "-march=native" else "-march=x86-64-v3"
                                  for f in native["extra_cflags"]]
    assert native["name"] != v3["name"]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _has_avx2(),
                    reason="x86-64-v3 code runs only on an x86 CPU with AVX2")
def test_kernels_built_for_avx2_match_their_references():
    here = Path(__file__).resolve().parent
    suites = [str(here / f) for f in ("test_kernels_cpu_decode.py", "test_kernels_cpu_fused.py",
                                       "test_kernels_cpu_sampling.py")]
    env = os.environ | {"FORMWORK_CPU_MARCH": "x86-64-v3"}
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *suites], env=env, capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
