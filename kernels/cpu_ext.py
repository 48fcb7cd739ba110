"""Build-on-first-use for formwork's small C++ CPU extensions.

Each source is compiled with the machine's C++ compiler and -march=native into a
Python extension module, cached under `$FORMWORK_CACHE/kernels` (default
`~/.cache/formwork/kernels`) by a name keyed by the source, the flags, the CPU's
feature flags, the compiler, Python and the torch installation, so a changed
source, another CPU or another venv rebuilds. A failed build returns None and is
remembered: callers keep their torch path. `FORMWORK_CPU_MARCH` (e.g.
`x86-64-v3`: AVX2 without AVX-512) builds for another CPU level than this
machine's, so the paths other machines take can be tested here.

Why not torch's `cpp_extension.load_inline`, which built these kernels first: it
puts `torch/extension.h` (all of torch's C++ frontend) in front of every source,
and that took 29 of the ~30 s each extension needed to compile on a 2-core box
(three extensions: ~90 s at a fresh machine's first engine start). The sources
here see only what they use: `at::Tensor`, `at::parallel_for`, the dtype switch
macros and torch's pybind11 tensor caster (`torch/csrc/utils/pybind.h`), the
same binding load_inline generates (`m.def` per function, tensors passed as
at::Tensor: a call costs ~0.2 us), compiled in ~8 s. torch's helpers still give
the include and library paths and the C++ ABI flag.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading

log = logging.getLogger("formwork.kernels")

_lock = threading.Lock()                 # guards _locks
_locks: dict[str, threading.Lock] = {}   # one per extension: different ones build side by side
_built: dict[str, object] = {}
_failures: dict[str, str] = {}
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_BUILD = "compile and link apart"     # part of the cache key: a build rule change rebuilds

# What every source sees first (load_inline's `torch/extension.h`, narrowed).
_PRELUDE = """\
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
"""


def _binding(module: str, functions: list[str]) -> str:
    defs = "".join(f'  m.def("{f}", &{f}, "{f}");\n' for f in functions)
    return f"\nPYBIND11_MODULE({module}, m) {{\n{defs}}}\n"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cache_dir() -> pathlib.Path:
    """Where built kernels are kept: `$FORMWORK_CACHE/kernels` (the cache root the
    model files use), else `~/.cache/formwork/kernels`."""
    env = os.environ.get("FORMWORK_CACHE")
    return (pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "formwork") / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    return cxx


def compile_command(source_path: str, out_path: str, flags: list[str]) -> list[str]:
    """The compiler's command line for one extension's object file (torch's and
    Python's headers)."""
    import torch
    from torch.utils.cpp_extension import include_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [_compiler(), *flags, "-std=c++20", "-fPIC", "-w", "-c",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]),
            source_path, "-o", out_path]


def link_command(object_path: str, out_path: str) -> list[str]:
    """The link of the extension module, against torch's libraries. Without the compile
    flags: `-ffast-math` on a link pulls in crtfastmath.o, whose constructor sets
    flush-to-zero for the whole process when the module loads (every float op of
    torch, numpy and Python after it would lose subnormals), as load_inline's link did
    not."""
    from torch.utils.cpp_extension import library_paths
    libs = library_paths()
    return [_compiler(), "-shared", "-fopenmp", object_path, "-o", out_path,
            *(f"-L{p}" for p in libs), "-lc10", "-ltorch_cpu", "-ltorch_python",
            *(f"-Wl,-rpath,{p}" for p in libs)]


def _key(flags: list[str], source: str) -> str:
    import torch
    key = "\n".join([_BUILD, _cpu_flags(), " ".join(flags), _compiler(), sys.version,
                     torch.__version__, os.path.dirname(torch.__file__), source])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def _compile(module: str, source: str, flags: list[str]) -> pathlib.Path:
    """The extension file of `source`, compiled unless the cache has it. One process
    compiles a module at a time (a lock file: tensor-parallel ranks and data-parallel
    engines start together), into a temporary folder renamed into place, so no
    process ever loads a half-written file."""
    root = cache_dir()
    target = root / f"{module}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{module}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():                      # another process built it meanwhile
            return target
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{module}-") as tmp:
            src, out = os.path.join(tmp, f"{module}.cpp"), os.path.join(tmp, target.name)
            with open(src, "w") as f:
                f.write(source)
            obj = os.path.join(tmp, f"{module}.o")
            for step, cmd in (("compile", compile_command(src, obj, flags)),
                              ("link", link_command(obj, out))):
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{step} failed ({proc.returncode}):\n"
                                       f"{proc.stderr[-4000:]}")
            os.replace(out, target)
    return target


def _import(module: str, path: pathlib.Path):
    import torch  # noqa: F401 - the extension links torch's libraries: load them first
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(name: str, source: str, functions: list[str], cflags: list[str] | None = None):
    """The compiled module, or None if it cannot be built here (see `failure`).
    `functions`: the C++ functions to expose (tensors as at::Tensor, numbers as
    double / int64_t). `cflags`: instead of CFLAGS (a source that compares NaN or
    inf leaves out -ffast-math)."""
    with _lock:
        name_lock = _locks.setdefault(name, threading.Lock())
    with name_lock:
        if name in _built:
            return _built[name]
        if name in _failures:
            return None
        flags = CFLAGS if cflags is None else cflags
        march = os.environ.get("FORMWORK_CPU_MARCH")
        if march:
            flags = [f"-march={march}" if f == "-march=native" else f for f in flags]
        try:
            # the key covers the exposed functions too: the binding is part of the build
            module = f"{name}_{_key(flags, _PRELUDE + source + ' '.join(functions))}"
            path = _compile(module, _PRELUDE + source + _binding(module, functions), flags)
            mod = _import(module, path)
        except Exception as e:  # noqa: BLE001 - any build failure means: keep the torch path
            _failures[name] = f"{type(e).__name__}: {e}"
            log.warning("C++ extension %s unavailable, using the torch path: %s", name,
                        _failures[name].splitlines()[0][:300])
            return None
        _built[name] = mod
        return mod


def failure(name: str) -> str | None:
    """Why `name` did not build (None if it built or was never tried)."""
    return _failures.get(name)
