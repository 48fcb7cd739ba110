#!/usr/bin/env bash
# Run where pip reaches a registry, before a run on a GPU machine that has none. Fills DEST (default
# .gpu_carry/) with what bench/gpu_check.sh needs beside the GPU image's own
# torch, triton and numpy:
#   DEST/whl/         cp312 manylinux wheels of formwork's runtime dependencies and
#                     everything they require (markers read for CPython 3.12 on
#                     Linux), at the versions installed here, so the GPU side runs
#                     the versions the test suite ran, not the image's
#   DEST/model-meta/  the default model's config.json and tokenizer files (the GPU
#                     side draws random weights, load_format=dummy: the GGUF exceeds
#                     the 64 MiB that may travel)
# DEST is in .gitignore: copy it to the GPU machine beside the checkout.
#
#   PYTHON=.venv/bin/python bash bench/gpu/prepare_carry.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu_carry}
PY=${PYTHON:-python}
ROOTS="xgrammar outlines-core llguidance transformers safetensors fastapi uvicorn pyzmq msgspec
       jsonschema jsonschema-rs pydantic tqdm httpx prometheus_client"
# the image's CUDA builds of these stay; gguf/accelerate/openai are not on the GPU path
SKIP="torch triton numpy sympy mpmath networkx jinja2 markupsafe filelock fsspec setuptools"
rm -rf "$DEST/whl"
mkdir -p "$DEST/whl" "$DEST/model-meta"
PINS=$("$PY" - "$ROOTS" "$SKIP" <<'PY'
import sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
skip = {canon(n) for n in sys.argv[2].split()}
seen, todo = {}, [canon(n) for n in sys.argv[1].split()]
while todo:
    name = todo.pop()
    if name in seen or name in skip or name.startswith(("nvidia-", "cuda-")):
        continue
    dist = metadata.distribution(name)          # raises if a dependency is not installed here
    seen[name] = dist.version
    for req in map(Requirement, dist.requires or []):
        if req.marker is None or req.marker.evaluate(env):
            todo.append(canon(req.name))
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PY
)
PLATFORMS=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_35_x86_64 manylinux1_x86_64; do
  PLATFORMS="$PLATFORMS --platform $p"
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS -d "$DEST/whl" $PINS
"$PY" - "$DEST/model-meta" <<'PY'
import shutil, sys, pathlib
from formwork.gpu.model_files import resolve_model
src = resolve_model(None)
for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "special_tokens_map.json", "generation_config.json"):
    if (src / name).is_file():
        shutil.copy(src / name, pathlib.Path(sys.argv[1]) / name)
PY
echo "$(ls "$DEST/whl" | wc -l) wheels for: $PINS"
du -sh "$DEST"
