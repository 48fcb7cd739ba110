"""Packaging: one `formwork` namespace that shadows nothing, and a non-editable install
that serves. Each test runs what a user would run, in a fresh interpreter."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import openai
import pytest

from test_server import KEY, Server

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("gateway", "core", "grammar", "gpu", "kernels", "schemas")
BARE_IMPORT = re.compile(rf"^(from|import) ({'|'.join(FOLDERS)})\b", re.M)
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}


def project_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".venv")
                       and not d.endswith(".egg-info")]
        for name in filenames:
            yield pathlib.Path(dirpath, name)


def source_copy(dest: pathlib.Path) -> pathlib.Path:
    """The checkout without venvs and build outputs: pip builds a local project in
    place, and its build/ must not land in the checkout."""
    shutil.copytree(ROOT, dest, ignore=lambda d, names: [
        n for n in names if n in SKIP_DIRS or n.startswith(".venv") or n.endswith(".egg-info")])
    return dest


def test_no_import_under_a_bare_folder_name():
    """The issue's grep: no `from core ...` / `import kernels ...` anywhere in the project."""
    hits = []
    for path in project_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in BARE_IMPORT.finditer(text)]
    assert hits == []


def test_checkout_root_shadows_nothing():
    """A plain `python -c` in the checkout root puts the working directory first on
    sys.path. Hugging Face's `kernels` (imported by transformers >= 5.25) must still be
    the installed one, formwork's kernels must come as `formwork.kernels`, and the
    default tokenizer must load through transformers."""
    code = textwrap.dedent(f"""
        import importlib.metadata, importlib.util, os, sys
        assert sys.path[0] == "", sys.path[:2]          # the checkout root is first
        import transformers.integrations.hub_kernels
        import kernels
        assert importlib.metadata.version("kernels")
        assert kernels.__file__ and not kernels.__file__.startswith({str(ROOT)!r} + "/kernels"), kernels.__file__
        assert hasattr(kernels, "CUDAProperties"), dir(kernels)
        import formwork.kernels.bitmask as bitmask
        assert callable(bitmask.apply_bitmask)
        for name in {FOLDERS!r}:   # no folder of the checkout is a regular package or module
            spec = importlib.util.find_spec(name)
            ours = os.path.join({str(ROOT)!r}, name)
            assert spec is None or spec.origin is None or not spec.origin.startswith(ours), spec
        from formwork.gpu.model_files import load_model_tokenizer
        tok = load_model_tokenizer(None)
        ids = tok.encode("Hello, formwork!")
        assert len(tok) == 49152 and tok.decode(ids) == "Hello, formwork!", (len(tok), ids)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_public_names():
    code = textwrap.dedent("""
        from formwork import LLM, SamplingParams, StructuredOutputsParams, Logprob
        from formwork.kernels.paged_attention import paged_attention
        from formwork.kernels.kv_store import store_kv
        from formwork.kernels.bitmask import apply_bitmask
        import formwork
        assert LLM.__module__ == "formwork.gateway.llm", LLM.__module__
        assert {"LLM", "SamplingParams", "StructuredOutputsParams", "Logprob"} <= set(formwork.__all__)
        try:
            formwork.NoSuchName
        except AttributeError as e:
            assert "NoSuchName" in str(e)
        else:
            raise SystemExit("formwork.NoSuchName resolved")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd="/", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_vllms_module_paths():
    """A vLLM script runs with only `vllm` renamed: `from vllm.sampling_params import
    StructuredOutputsParams` (vLLM's documented import) and `from vllm.outputs import
    RequestOutput` resolve to formwork's own classes; the first loads no torch."""
    code = textwrap.dedent("""
        import sys
        from formwork.sampling_params import SamplingParams, StructuredOutputsParams
        import formwork
        assert SamplingParams is formwork.SamplingParams
        assert StructuredOutputsParams is formwork.StructuredOutputsParams
        assert "torch" not in sys.modules
        from formwork.outputs import CompletionOutput, RequestOutput
        import formwork.outputs as outputs
        assert RequestOutput.__module__ == "formwork.gateway.output_processor"
        assert outputs.CompletionOutput is CompletionOutput
        try:
            from formwork.outputs import NoSuchName
        except ImportError:
            print("ok")
    """)
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd="/", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_version_and_python_dash_m():
    """`formwork --version` and `python -m formwork` (the same command), from outside
    the checkout, say the installed version."""
    from importlib import metadata

    want = f"formwork {metadata.version('formwork')}"
    bindir = pathlib.Path(sys.executable).parent
    for cmd in ([str(bindir / "formwork"), "--version"],
                [sys.executable, "-P", "-m", "formwork", "--version"]):
        proc = subprocess.run(cmd, cwd="/", capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == want, (cmd, proc.stdout, proc.stderr)
    proc = subprocess.run([sys.executable, "-P", "-m", "formwork", "extract", "--help"], cwd="/",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--schema" in proc.stdout


def test_wheel_installs_only_formwork(tmp_path):
    """The built wheel holds `formwork/` and its dist-info, nothing at the top level
    under another name (the six folders included, tests and bench excluded)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(source_copy(tmp_path / "src"))], check=True,
                   timeout=300, env={**os.environ, "PIP_NO_INDEX": "1"})
    (wheel,) = tmp_path.glob("formwork-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"formwork", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                    + ".dist-info"}, tops
    for folder in FOLDERS:
        assert f"formwork/{folder}/__init__.py" not in names
        assert any(n.startswith(f"formwork/{folder}/") and n.endswith(".py") for n in names), folder
    # a sub-package (gateway/extract/) not listed in pyproject's `packages` works editable
    # but is left out of the wheel
    left_out = [p.relative_to(ROOT).as_posix() for folder in FOLDERS
                for p in (ROOT / folder).rglob("*.py")
                if f"formwork/{p.relative_to(ROOT).as_posix()}" not in names]
    assert left_out == [], left_out
    assert "formwork/__init__.py" in names
    assert "formwork/__main__.py" in names                       # python -m formwork
    assert not any(n.startswith(("formwork/tests/", "formwork/bench/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "formwork = formwork.gateway.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.slow
def test_non_editable_install_serves(tmp_path):
    """`pip install .` (not editable) into a fresh venv; from another folder its
    `formwork serve` answers /health and one chat request. The dependencies come from
    this test's environment (a .pth line, added after the install, so pip leaves that
    environment alone): installing torch and the rest again took ~150 s of the suite's
    ~20 minutes, and `make install` on a fresh clone resolves them with the same
    constraints. `pip check` then says whether they satisfy what the wheel declares."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    vpy = str(venv / "bin" / "python")
    env = {**os.environ, "PIP_CONSTRAINT": str(ROOT / "constraints.txt")}
    src = str(source_copy(tmp_path / "src"))
    proc = subprocess.run([vpy, "-m", "pip", "install", "-q", "--no-deps", src], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    pathlib.Path(site, "test-deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    check = subprocess.run([vpy, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    unmet = [line for line in check.stdout.splitlines() if line.lower().startswith("formwork ")]
    assert unmet == [], unmet
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import formwork.kernels.bitmask as b; print(b.__file__)"],
        cwd=elsewhere, capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert installed.startswith(str(venv)), installed
    server = Server("--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory-gb", "0.25",
                    formwork=(str(venv / "bin" / "formwork"),), cwd=str(elsewhere))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    finally:
        server.stop()
