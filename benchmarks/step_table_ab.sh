#!/bin/bash
# The decode step table of an earlier commit and of this checkout, alternated run by run.
#
#   BASE=<git worktree of the earlier commit> OUT=<folder> [RUNS="1 2"] [BATCHES=1,16] \
#       bash benchmarks/step_table_ab.sh
#
# "before" puts BASE's packages first on PYTHONPATH, "after" runs this checkout's; both run
# this checkout's benchmarks/throughput.py (step table only, GGUF default model; the read
# rate is measured between each row's rounds), so the box's drift hits both alike. Writes
# OUT/before-N.json and OUT/after-N.json for each N in RUNS.
set -u
BASE=${BASE:?git worktree of the earlier commit}
OUT=${OUT:-step-table-ab}
BATCHES=${BATCHES:-1,16}
mkdir -p "$OUT"
PP=$(ls -d "$BASE"/packages/*/src | tr '\n' ':')
for i in ${RUNS:-1 2}; do
  PYTHONPATH=$PP uv run --no-sync python benchmarks/throughput.py --skip-pagemill --skip-transformers --mode gguf --step-batch-sizes "$BATCHES" --json "$OUT/before-$i.json"
  uv run --no-sync python benchmarks/throughput.py --skip-pagemill --skip-transformers --mode gguf --step-batch-sizes "$BATCHES" --json "$OUT/after-$i.json"
done
