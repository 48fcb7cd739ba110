#!/usr/bin/env bash
# One prepared check for a lent GPU (H200; under 8 minutes), results as markdown:
#   1. torch + triton importable and CUDA visible (clear message if not)
#   2. kernel tests on CUDA at real sizes, bf16 included (no interpreter), and
#      tests/test_cuda_graph.py with real CUDA-graph capture of the decode step
#   3. kernel timings: decode/prefill paged attention vs torch gather+SDPA,
#      achieved K/V bandwidth vs the measured copy rate; bitmask apply at
#      batch 1/64/512 vs xgrammar's apply and the torch implementation
#   4. bench/offline_throughput.py, bench/structured_overhead.py and
#      bench/gpu/decode_graphs.py (decode tok/s, CUDA graphs vs eager) with
#      --device cuda, on a random-weight copy of the default model
# Nothing is downloaded. Packages the GPU image lacks and the model's config and
# tokenizer come from $GPU_CARRY (default .gpu_carry/, filled beforehand by
# bench/gpu/prepare_carry.sh); without it, step 4 is skipped with a message.
#
#   bash bench/gpu_check.sh            # on the GPU machine
#   bash bench/gpu_check.sh --dry-run  # on a CPU: interpreter, tiny sizes, step 4 --help only
#
# Logs and JSON go to $OUT (if set) or /tmp/formwork-gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-$(command -v python || command -v python3)}
OUTDIR=${OUT:-/tmp/formwork-gpu-check}
CARRY=${GPU_CARRY:-.gpu_carry}
mkdir -p "$OUTDIR"
# The checkout root is the package `formwork` (pyproject.toml's package-dir): without
# installing it, a link named formwork on PYTHONPATH makes `import formwork.*` work.
FW_PATH=$(mktemp -d /tmp/formwork-path.XXXXXX)
ln -s "$PWD" "$FW_PATH/formwork"
export PYTHONUNBUFFERED=1 PYTHONPATH="$FW_PATH${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=""

run_step() {  # run_step NAME LIMIT_S CMD... : runs CMD under a time limit, records the outcome
  local name=$1 limit=$2 start rc status
  shift 2
  echo; echo "## $name"; echo
  start=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee -a "$OUTDIR/log.txt"
  rc=${PIPESTATUS[0]}
  case $rc in 0) status=ok ;; 124) status="TIMED OUT (${limit}s)" ;; *) status="FAILED (rc $rc)" ;; esac
  SUMMARY+="| $name | $status | $(( $(date +%s) - start )) |"$'\n'
}

skip_step() {
  echo; echo "## $1"; echo; echo "skipped: $2"
  SUMMARY+="| $1 | skipped: $2 | 0 |"$'\n'
}

# -- 0. carried wheels (GPU only)
if [ $DRY = 0 ] && compgen -G "$CARRY/whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/formwork-site "$CARRY"/whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/formwork-site"
fi

# -- 1. environment
if ! "$PY" -c 'import torch, triton' 2>/dev/null; then
  echo "gpu_check: '$PY' cannot import torch and triton; run with a Python that has both"
  echo "(set PYTHON=...), or carry their wheels in $CARRY/whl (bench/gpu/prepare_carry.sh)."
  exit 2
fi
"$PY" - "$DRY" <<'PY' || exit 2
import sys, torch, triton
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
elif sys.argv[1] == "0":
    sys.exit("gpu_check: torch sees no CUDA device; on a CPU use --dry-run")
else:
    print("device: cpu (dry run: Triton interpreter)")
PY

# -- 2. kernel tests
TESTS="tests/test_kernels_bitmask.py tests/test_kernels_kv_store.py tests/test_kernels_paged_attention.py tests/test_kernels_engine.py tests/test_cuda_graph.py"
if [ $DRY = 1 ]; then
  run_step "kernel tests (interpreter subset)" 300 env TRITON_INTERPRET=1 "$PY" -m pytest $TESTS \
    -q -p no:cacheprovider -m "not slow" \
    -k "hand_example or dispatch or int32_slots or test_dtypes or decode_only or backend_matches or graph_rows or padded_size"
else
  run_step "kernel tests (CUDA)" 180 "$PY" -m pytest $TESTS -q -p no:cacheprovider -m "not slow"
fi

# -- 3. kernel timings
BENCH_ARGS=(--json "$OUTDIR/kernels.json")
[ $DRY = 1 ] && BENCH_ARGS+=(--dry-run)
run_step "kernel timings" 240 "$PY" bench/gpu/kernel_bench.py "${BENCH_ARGS[@]}"

# -- 4. engine benchmarks
ENGINE_BENCHES="offline_throughput structured_overhead gpu/decode_graphs"
if [ $DRY = 1 ]; then
  for b in $ENGINE_BENCHES; do
    if [ -f "bench/$b.py" ]; then run_step "$b (--help only)" 60 "$PY" "bench/$b.py" --help
    else skip_step "$b" "bench/$b.py does not exist"; fi
  done
elif ! "$PY" -c 'import formwork.gateway.llm, formwork.core.engine_core' 2> "$OUTDIR/import_error.txt"; then
  for b in $ENGINE_BENCHES; do
    skip_step "$b" "engine imports fail ($(tail -1 "$OUTDIR/import_error.txt")); carry $CARRY/whl"
  done
elif [ ! -f "$CARRY/model-meta/config.json" ] && [ -z "${FORMWORK_MODEL:-}" ]; then
  for b in $ENGINE_BENCHES; do
    skip_step "$b" "no model: carry $CARRY/model-meta (bench/gpu/prepare_carry.sh) or set FORMWORK_MODEL"
  done
else
  MODEL=${FORMWORK_MODEL:-/tmp/formwork-random-model}
  [ -n "${FORMWORK_MODEL:-}" ] || run_step "random-weight model" 120 \
    "$PY" bench/gpu/random_model.py "$CARRY/model-meta" "$MODEL"
  for b in $ENGINE_BENCHES; do
    if [ -f "bench/$b.py" ]; then
      run_step "$b" 150 "$PY" "bench/$b.py" --model "$MODEL" --device cuda
    else
      skip_step "$b" "bench/$b.py does not exist"
    fi
  done
fi

echo
echo "## summary"
echo
echo "| step | status | seconds |"
echo "|---|---|---|"
printf "%s" "$SUMMARY"
