#!/bin/bash
# The engine's OpenMP spin (GOMP_SPINCOUNT, the engine's default 20000) against 2000 and 200:
# a fresh server per run, `pagemill bench serve --concurrency 1,16`, alternated twice.
set -u
OUT=${OUT:-spin-out}
for i in 1 2; do
  for sc in 20000 2000 200; do
    GOMP_SPINCOUNT=$sc uv run --no-sync pagemill serve --port 8125 > "$OUT-server.log" 2>&1 &
    for t in $(seq 120); do curl -sf http://127.0.0.1:8125/health >/dev/null && break; sleep 0.5; done
    uv run --no-sync pagemill bench serve --base-url http://127.0.0.1:8125 --concurrency 1,16 \
      --num-prompts 8,32 --out-dir "$OUT" --tag "sc$sc-$i" > /dev/null 2>&1
    pkill -f "pagemill serve --port 8125"; sleep 3
  done
done
