#!/usr/bin/env bash
# One prepared check for a CUDA machine (H200: about 4.5 minutes), results as markdown:
#   1. torch + triton importable and CUDA visible (clear message if not)
#   2. kernel tests on CUDA (no interpreter), bf16 included, slow ones too, and
#      tests/test_cuda_graph.py with real CUDA-graph capture of the decode step
#      (the engine-level ones read the tokenizer from $GPU_CARRY/model-meta)
#   3. kernel timings: decode/prefill paged attention vs torch gather+SDPA,
#      achieved K/V bandwidth vs the measured copy rate; bitmask apply at
#      batch 1/64/512 vs xgrammar's apply and the torch implementation
#   4. engine benchmarks with load_format=dummy (random weights drawn on the GPU
#      from config.json alone): bench/gpu/decode_graphs.py (decode tok/s, CUDA
#      graphs vs eager) on the default model's shape and on a Llama-3-8B shape
#      with the default vocabulary (memory-bound decode, as in real serving);
#      bench/structured_overhead.py on the 8B shape at batch 32 and 128 with the
#      step timeline; bench/offline_throughput.py on the default shape
# Nothing is downloaded. Packages the GPU image lacks and the model's config and
# tokenizer come from $GPU_CARRY (default .gpu_carry/, filled beforehand by
# bench/gpu/prepare_carry.sh); without it, step 4 is skipped with a message.
#
#   bash bench/gpu_check.sh            # on the GPU machine
#   bash bench/gpu_check.sh --dry-run  # on a CPU: interpreter, tiny sizes, step 4 at toy sizes
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
# GPU_CHECK_STEPS: a subset of "tests timings decode profile structured offline"
# (default all), for a rerun
STEPS=${GPU_CHECK_STEPS:-tests timings decode profile structured offline}
want() { [[ " $STEPS " == *" $1 "* ]]; }

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
TESTS="tests/test_kernels_fused.py tests/test_kernels_bitmask.py tests/test_kernels_kv_store.py tests/test_kernels_paged_attention.py tests/test_kernels_engine.py tests/test_cuda_graph.py"
if ! want tests; then
  skip_step "kernel tests" "not in GPU_CHECK_STEPS"
elif [ $DRY = 1 ]; then
  run_step "kernel tests (interpreter subset)" 300 env TRITON_INTERPRET=1 "$PY" -m pytest $TESTS \
    -q -p no:cacheprovider -m "not slow" \
    -k "hand_example or dispatch or int32_slots or test_dtypes or decode_only or backend_matches or graph_rows or padded_size"
else
  XDIST=""
  "$PY" -c 'import xdist' 2>/dev/null && XDIST="-n 4"    # Triton compiles in parallel
  run_step "kernel tests (CUDA)" 130 env FORMWORK_TEST_TOKENIZER_DIR="$PWD/$CARRY/model-meta" \
    "$PY" -m pytest $TESTS -q -p no:cacheprovider $XDIST -rs --durations=5
fi

# -- 3. kernel timings
BENCH_ARGS=(--json "$OUTDIR/kernels.json")
[ $DRY = 1 ] && BENCH_ARGS+=(--dry-run)
want timings && run_step "kernel timings" 80 "$PY" bench/gpu/kernel_bench.py "${BENCH_ARGS[@]}"

# -- 4. engine benchmarks (weightless model folders, load_format=dummy)
SMALL=/tmp/formwork-dummy-small BIG=/tmp/formwork-dummy-8b
if [ $DRY = 1 ]; then    # toy sizes on the CPU: proves the commands, times nothing
  SIZES=(--batch-sizes 1,2 --output-len 4) SO_SIZES=(--batches 2 --output-len 4 --reps 1)
  OT_SIZES=(--num-requests 4) SP_SIZES=(--batch 2 --steps 2) BIG_SHAPE=same DEVICE=cpu
  [ -f "$CARRY/model-meta/config.json" ] || CARRY_META=$("$PY" -c \
    'from formwork.gpu.model_files import resolve_model; print(resolve_model(None))')
else
  SIZES=() SO_SIZES=(--batches 32 128 --output-len 64 --reps 2) OT_SIZES=() SP_SIZES=()
  BIG_SHAPE=llama3-8b DEVICE=cuda
fi
META=${CARRY_META:-$CARRY/model-meta}
if ! { want decode || want profile || want structured || want offline; }; then
  skip_step "engine benchmarks" "not in GPU_CHECK_STEPS"
elif [ $DRY = 0 ] && ! "$PY" -c 'import formwork.gateway.llm, formwork.core.engine_core' 2> "$OUTDIR/import_error.txt"; then
  skip_step "engine benchmarks" "engine imports fail ($(tail -1 "$OUTDIR/import_error.txt")); carry $CARRY/whl"
elif [ ! -f "$META/config.json" ]; then
  skip_step "engine benchmarks" "no model config: carry $CARRY/model-meta (bench/gpu/prepare_carry.sh)"
else
  "$PY" bench/gpu/random_model.py "$META" "$SMALL" && "$PY" bench/gpu/random_model.py "$META" "$BIG" --shape "$BIG_SHAPE"
  D=(--load-format dummy --device "$DEVICE")
  want decode && run_step "decode_graphs, default shape" 55 "$PY" bench/gpu/decode_graphs.py --model "$SMALL" "${D[@]}" \
    --batch-sizes 1,8,64 "${SIZES[@]}" --json "$OUTDIR/decode_small.json"
  want decode && run_step "decode_graphs, $BIG_SHAPE shape" 85 "$PY" bench/gpu/decode_graphs.py --model "$BIG" "${D[@]}" \
    --batch-sizes 1,32,128 --output-len 64 "${SIZES[@]}" --json "$OUTDIR/decode_big.json"
  want profile && run_step "step_profile, $BIG_SHAPE shape" 45 "$PY" bench/gpu/step_profile.py --model "$BIG" \
    --load-format dummy --device "$DEVICE" --batch 32 "${SP_SIZES[@]}"
  for variant in "" --eager-masks --no-budget-aware; do    # deferred masks are the default
    want structured && run_step "structured_overhead, $BIG_SHAPE shape ${variant:-(defaults)}" 70 "$PY" \
      bench/structured_overhead.py --model "$BIG" "${D[@]}" "${SO_SIZES[@]}" --timeline \
      --skip-jump-forward $variant
  done
  want offline && run_step "offline_throughput, default shape" 40 "$PY" bench/offline_throughput.py --model "$SMALL" \
    "${D[@]}" "${OT_SIZES[@]}"
fi

{
  echo; echo "## summary"; echo
  echo "| step | status | seconds |"; echo "|---|---|---|"
  printf "%s" "$SUMMARY"
} | tee "$OUTDIR/summary.md"
