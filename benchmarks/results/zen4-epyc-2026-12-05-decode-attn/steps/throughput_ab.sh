#!/bin/bash
# The decode step table of the commit before (BASE: a worktree of 6b1e01e, its packages put
# first on PYTHONPATH) and of this one, alternated twice, both with this commit's
# benchmarks/throughput.py (the read rate measured between each row's rounds).
set -u
BASE=${BASE:?worktree of the commit before}
OUT=${OUT:-tp-out}
mkdir -p "$OUT"
PP=$(ls -d "$BASE"/packages/*/src | tr '\n' ':')
for i in ${RUNS:-1 2}; do
  PYTHONPATH=$PP uv run --no-sync python benchmarks/throughput.py --skip-pagemill --skip-transformers --mode gguf --step-batch-sizes 1,16,64 --json "$OUT/before-$i.json"
  uv run --no-sync python benchmarks/throughput.py --skip-pagemill --skip-transformers --mode gguf --step-batch-sizes 1,16,64 --json "$OUT/after-$i.json"
done
