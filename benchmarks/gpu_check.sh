#!/usr/bin/env bash
# The first thing to run on a CUDA machine: pagemill's GPU checks and figures, in < 8 minutes.
#
#   benchmarks/gpu_check.sh [RESULTS_DIR] [--cpu]
#
# For a bare machine whose python has torch (>= 2.11), triton (>= 3.6), transformers, numpy
# and cupy, no network and none of the workspace's pins. It runs from the source tree
# (PYTHONPATH over packages/*/src); pure-Python packages the machine lacks (fastapi,
# uvicorn, prometheus-client, xxhash, pytest, ...) are installed with `pip --no-index` from
# benchmarks/gpu_wheels/, prepared beforehand where the network is (benchmarks/gpu_wheels.sh)
# and carried along. Stages, each with its own time limit inside an overall budget:
#
#   deps          install the missing wheels (into a temporary folder, not the machine's python)
#   env           versions, GPU, driver
#   tests         the gpu-marked tests (pytest -m gpu; includes a Q4_0/Q4_1 GGUF served through
#                 the Triton int4 GEMM, eager and with CUDA graphs)
#   kernels       paged attention, Llama-3.1-8B heads, bf16: decode 64 x 4k in GB/s against a
#                 device-to-device copy measured in the same run, prefill in TFLOP/s
#                 (and the same over fp8 and int8 KV caches: --kv-cache-dtype fp8 / int8)
#   int4-gemm     the int4-group GEMM of AWQ/GPTQ/w4a16 weights on Llama-3.1-8B's projections
#                 (1, 16, 256 rows) vs a dense bf16 GEMM: ms, weight GB/s, error vs torch
#   moe           fused MoE (Triton grouped GEMM), Qwen3-30B-A3B expert shapes, bf16, 4 layers:
#                 decode step at batch 1/64/256 against transformers' eager MoE block
#   lora          many LoRA adapters (Triton shrink/expand) on the dummy model, rank 16: a decode
#                 step of 4 adapters x 16 requests vs 64 base requests, and adapter load time
#   model, plan   a dummy Llama-3.1-8B folder (config + synthetic tokenizer; random weights)
#                 and `pagemill plan`'s weight-streaming roofline for this GPU (3.35 ms on H200)
#   steps-eager   decode step time, batch 1..256, EngineConfig.enforce_eager=True
#   steps-graphs  the same with enforce_eager=False: CUDA graphs per batch-size bucket (each row
#                 records how many timed steps replayed a graph); the merged table adds the
#                 eager/graphs speedup per batch size
#   serve         a short `pagemill bench serve` against a server it launches on the dummy model
#
# Everything lands in RESULTS_DIR (default $RESULTS_DIR, else benchmarks/out/gpu-check-<time>):
# gpu_check.json (all results, the targets of issue 12 evaluated), one JSON per stage,
# logs/<stage>.log and stages.jsonl. A failing stage is recorded and the next one runs.
# --cpu runs every stage on CPU with tiny shapes (a tiny random Llama): a dry run of the
# same code. GPU_CHECK_BUDGET_S (default 450) caps the whole run; PYTHON picks the python.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CPU=0
RESULTS=""
for arg in "$@"; do
  case "$arg" in
    --cpu) CPU=1 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) RESULTS="$arg" ;;
  esac
done
RESULTS="${RESULTS:-${RESULTS_DIR:-$REPO/benchmarks/out/gpu-check-$(date +%Y%m%d-%H%M%S)}}"
mkdir -p "$RESULTS/logs"
RESULTS="$(cd "$RESULTS" && pwd)"
: > "$RESULTS/stages.jsonl"
# The python that has torch: $PYTHON, else python3, else python.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3 python; do
    if command -v "$cand" >/dev/null && "$cand" -c "import torch" 2>/dev/null; then PY="$cand"; break; fi
  done
  PY="${PY:-python3}"
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pagemill-gpu-check.XXXXXX")"
DEPS="$WORK/pydeps"
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
DEADLINE=$((SECONDS + BUDGET))

SRC=""
for d in "$REPO"/packages/*/src; do SRC="$SRC${SRC:+:}$d"; done
export PYTHONPATH="$SRC:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PAGEMILL_CACHE_DIR="$WORK/cache"
unset TRITON_INTERPRET PAGEMILL_ENFORCE_EAGER
CHECK=("$PY" "$REPO/benchmarks/gpu_check.py")
FLAG=()
if [ "$CPU" = 1 ]; then
  FLAG=(--cpu)
  # Tiny shapes: one thread each (on shared cores, idle OpenMP workers cost more than the work).
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
fi

# stage NAME SECONDS COMMAND...: run with a time limit (its own, or what the budget has left).
stage() {
  local name="$1" limit="$2"
  shift 2
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$limit" ] && limit="$left"
  if [ "$limit" -lt 10 ]; then
    echo "{\"stage\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"budget spent\"}" >> "$RESULTS/stages.jsonl"
    echo "== $name: skipped (budget spent)"
    return
  fi
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=15 "$limit" "$@" > "$RESULTS/logs/$name.log" 2>&1
  local rc=$?
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"limit_s\": $limit}" >> "$RESULTS/stages.jsonl"
  tail -n 25 "$RESULTS/logs/$name.log"
  [ "$rc" = 0 ] || echo "== $name: exit $rc (timeout: 124/137); see $RESULTS/logs/$name.log"
}

cd "$REPO"
if [ "$CPU" = 1 ]; then
  MODEL_KIND=tiny; SIZES="1,2,4,8"; STEP_ARGS=(--iters 3 --warmup 1 --context 16 --max-tokens 64)
else
  MODEL_KIND=llama-3.1-8b; SIZES="1,2,4,8,16,32,64,128,256"
  STEP_ARGS=(--iters 10 --warmup 3 --context 128 --max-tokens 512 --kv-cache-gib 24)
fi
MODEL="$WORK/model-$MODEL_KIND"

stage deps 40 "${CHECK[@]}" deps --wheels "$REPO/benchmarks/gpu_wheels" --target "$DEPS" --out "$RESULTS/deps.json"
stage env 20 "${CHECK[@]}" env --out "$RESULTS/env.json"
stage tests 110 "${CHECK[@]}" tests --out "$RESULTS/tests.json"
stage kernels 60 "${CHECK[@]}" kernels "${FLAG[@]}" --out "$RESULTS/kernels.json"
stage int4-gemm 30 "${CHECK[@]}" int4-gemm "${FLAG[@]}" --out "$RESULTS/int4-gemm.json"
stage moe 45 "${CHECK[@]}" moe "${FLAG[@]}" --out "$RESULTS/moe.json"
stage model 20 "${CHECK[@]}" model --kind "$MODEL_KIND" --dir "$MODEL"
stage lora 60 "${CHECK[@]}" lora "${FLAG[@]}" --model-dir "$MODEL" --out "$RESULTS/lora.json"
# The step table's contexts: prompt + the tokens decoded by the time each row is timed.
stage plan 20 "${CHECK[@]}" plan "${FLAG[@]}" --model-dir "$MODEL" --batch-sizes "$SIZES" --out "$RESULTS/plan.json"
stage steps-eager 75 "${CHECK[@]}" steps "${FLAG[@]}" --model-dir "$MODEL" --mode eager --batch-sizes "$SIZES" "${STEP_ARGS[@]}" --out "$RESULTS/steps-eager.json"
stage steps-graphs 90 "${CHECK[@]}" steps "${FLAG[@]}" --model-dir "$MODEL" --mode graphs --batch-sizes "$SIZES" "${STEP_ARGS[@]}" --out "$RESULTS/steps-graphs.json"
stage serve 80 "${CHECK[@]}" serve "${FLAG[@]}" --model-dir "$MODEL" --out "$RESULTS/serve.json"
# The merge always runs: it is what a session reads.
DEADLINE=$((DEADLINE + 30))
stage merge 30 "${CHECK[@]}" merge "$RESULTS"
rm -rf "$WORK"
echo "results: $RESULTS/gpu_check.json (total $((SECONDS))s)"
