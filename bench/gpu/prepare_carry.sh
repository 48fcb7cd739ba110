#!/usr/bin/env bash
# Run where pip reaches a registry, before a GPU session. Fills DEST (default
# .gpu_carry/) with what the GPU image lacks for bench/gpu_check.sh:
#   DEST/whl/         cp312 manylinux wheels of the engine's missing packages,
#                     the versions installed in this venv
#   DEST/model-meta/  the default model's config.json and tokenizer files
#                     (the GPU side draws random weights: the GGUF exceeds the
#                     64 MiB that may travel)
# Then keep DEST out of git (e.g. `echo /.gpu_carry/ >> .git/info/exclude`)
# and carry it: run(command="bash bench/gpu_check.sh", carry=[".gpu_carry"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu_carry}
PKGS="msgspec pyzmq fastapi starlette pydantic pydantic_core annotated-types typing-inspection
      jsonschema jsonschema-specifications referencing rpds-py uvicorn xgrammar outlines_core"
mkdir -p "$DEST/whl" "$DEST/model-meta"
PLATFORMS=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
  PLATFORMS="$PLATFORMS --platform $p"
done
for pkg in $PKGS; do
  version=$(python -m pip show "$pkg" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "prepare_carry: $pkg is not installed here" >&2; exit 1; }
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d "$DEST/whl" "$pkg==$version"
done
python - "$DEST/model-meta" <<'PY'
import shutil, sys, pathlib
from formwork.gpu.model_files import resolve_model
src = resolve_model(None)
for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "special_tokens_map.json", "generation_config.json"):
    if (src / name).is_file():
        shutil.copy(src / name, pathlib.Path(sys.argv[1]) / name)
PY
du -sh "$DEST"
