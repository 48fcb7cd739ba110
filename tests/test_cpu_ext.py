"""The C++ extension builder (kernels/cpu_ext.py): a built extension is loaded from
the cache without compiling again, and a source that does not compile leaves the
torch path with the compiler's message kept."""
import shutil
import subprocess

import pytest
import torch

from formwork.kernels import cpu_ext, cpu_sampling

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler on this machine")


def _fresh(monkeypatch):
    monkeypatch.setattr(cpu_ext, "_built", {})
    monkeypatch.setattr(cpu_ext, "_failures", {})


def test_a_built_extension_loads_from_the_cache_without_the_compiler(monkeypatch):
    assert cpu_sampling.available(), cpu_sampling.failure()      # built (or cached) here
    _fresh(monkeypatch)

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"compiled again: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    mod = cpu_ext.build(cpu_sampling._NAME, cpu_sampling._SOURCE, cpu_sampling._FUNCTIONS,
                        cflags=cpu_sampling._CFLAGS)
    assert mod is not None, cpu_ext.failure(cpu_sampling._NAME)
    x = torch.randn(3, 1000)
    values, indices = torch.empty(3), torch.empty(3, dtype=torch.int64)
    mod.row_max(x, values, indices)
    ref = x.max(-1)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)


def test_a_source_that_does_not_compile_gives_none_and_the_compiler_message(monkeypatch, tmp_path):
    _fresh(monkeypatch)
    monkeypatch.setenv("FORMWORK_CACHE", str(tmp_path))
    assert cpu_ext.build("formwork_broken", "int f( { return 1; }", ["f"]) is None
    why = cpu_ext.failure("formwork_broken")
    assert why.startswith("RuntimeError: compile failed") and "error" in why, why
    # remembered: asking again does not compile again
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert cpu_ext.build("formwork_broken", "int f( { return 1; }", ["f"]) is None
    assert not list((tmp_path / "kernels").glob("*.so"))            # nothing half-written kept


def test_loading_the_kernels_keeps_subnormal_floats():
    """A -ffast-math link would pull in crtfastmath.o, which sets flush-to-zero for the
    whole process when the module loads: torch's, numpy's and Python's own float math
    would lose subnormals (hypothesis refuses to run then). The kernels are compiled
    with -ffast-math, linked without it."""
    from formwork.kernels import cpu_decode_attention, cpu_fused_ops
    assert cpu_sampling.available() and cpu_fused_ops.available() and cpu_decode_attention.available()
    tiny = 5e-324                                   # the smallest subnormal double
    assert tiny * 1.0 > 0 and tiny / 2 == 0 and 1e-310 * 2 == 2e-310
    t = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in float32
    assert (t * 1.0).item() > 0 and float(torch.finfo(torch.float32).smallest_normal / 2) > 0


def test_the_cache_name_follows_the_exposed_functions(monkeypatch, tmp_path):
    """The binding (one m.def per function) is compiled with the source: another list
    of functions over the same source is another module, never a stale cached one."""
    names = []

    def fake_compile(module, source, flags):
        names.append(module)
        raise RuntimeError("not built")

    monkeypatch.setattr(cpu_ext, "_compile", fake_compile)
    monkeypatch.setenv("FORMWORK_CACHE", str(tmp_path))
    for functions in (["f"], ["f", "g"], ["f"]):
        _fresh(monkeypatch)
        assert cpu_ext.build("probe", "int f() { return 1; } int g() { return 2; }",
                             functions) is None
    assert names[0] != names[1] and names[0] == names[2]
