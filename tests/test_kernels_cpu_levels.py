"""The C++ CPU kernels as machines without AVX512-BF16 build them.

A CPU with AVX-512 and AVX512-BF16 compiles only the kernels' fastest paths with
`-march=native`; a CI runner or a laptop with AVX2 alone (many cloud AMD EPYCs),
or an Intel Xeon with AVX-512 but no BF16 (Skylake to Ice Lake), takes the others
(`#ifdef __AVX512BF16__` ... `#elif defined(__AVX2__)` ... generic).
`FORMWORK_CPU_MARCH` builds them for that level here, and the kernel suites run
again in a fresh process against their torch references (each suite asserts its
extension built: a fallback to torch would fail)."""
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


def test_march_override_reaches_the_compiler(monkeypatch, tmp_path):
    """What the suite below relies on: the variable replaces -march=native (and
    only that flag) on the compiler's command line and gives the build its own
    cache name."""
    from formwork.kernels import cpu_ext
    seen = []

    def fake_compile(module, source, flags):
        seen.append((module, cpu_ext.compile_command("x.cpp", "x.so", flags)))
        raise RuntimeError("not built")

    monkeypatch.setattr(cpu_ext, "_compile", fake_compile)
    monkeypatch.setenv("FORMWORK_CACHE", str(tmp_path))
    for march in (None, "x86-64-v3"):
        if march is None:
            monkeypatch.delenv("FORMWORK_CPU_MARCH", raising=False)
        else:
            monkeypatch.setenv("FORMWORK_CPU_MARCH", march)
        monkeypatch.setattr(cpu_ext, "_built", {})
        monkeypatch.setattr(cpu_ext, "_failures", {})
        assert cpu_ext.build("probe", "int f() { return 1; }", ["f"]) is None
    (native_name, native), (v3_name, v3) = seen
    assert "-march=native" in native
    assert v3 == [f if f != "-march=native" else "-march=x86-64-v3" for f in native]
    assert native_name != v3_name


# (-march, the CPU flags its code needs to run here, the suites whose kernels have
# code for that level: cpu_fused_ops has no ISA-specific code, the compiler
# vectorizes it for whatever it targets)
LEVELS = [("x86-64-v3", ("avx2",), ("test_kernels_cpu_decode.py", "test_kernels_cpu_sampling.py")),
          ("skylake-avx512", ("avx512f", "avx512bw", "avx512vl"),      # AVX-512 without BF16
           ("test_kernels_cpu_decode.py",))]


def _runs_here(march: str, needed: tuple[str, ...]) -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return platform.machine() in ("x86_64", "AMD64") and \
        all(re.search(rf"\b{f}\b", flags) for f in needed)


@pytest.fixture(scope="module")
def level_runs():
    """Both levels' suites started at once (their builds, single-threaded compiles,
    then run side by side on two cores instead of one after the other)."""
    here = Path(__file__).resolve().parent
    procs = {}
    for march, needed, suites in LEVELS:
        if HAVE_COMPILER and _runs_here(march, needed):
            procs[march] = subprocess.Popen(
                [sys.executable, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                 *(str(here / f) for f in suites)],
                env=os.environ | {"FORMWORK_CPU_MARCH": march}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("march,needed,suites", LEVELS, ids=[m for m, *_ in LEVELS])
def test_kernels_built_for_another_cpu_level_match_their_references(march, needed, suites,
                                                                    level_runs):
    if not _runs_here(march, needed):
        pytest.skip(f"code built for {march} does not run on this CPU")
    proc = level_runs[march]
    out, _ = proc.communicate(timeout=1200)
    tail = out[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
