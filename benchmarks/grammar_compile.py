"""What a JSON schema's grammar costs to compile, in process and through the compile workers.

    python benchmarks/grammar_compile.py                      # the default model's tokenizer
    python benchmarks/grammar_compile.py --model DIR --json out.json
    python benchmarks/grammar_compile.py --max-whitespace-cnt 32   # xgrammar's own cap

For schemas of 2, 6 and 12 properties (strings, integers, arrays of small objects), each
compiled as `pagemill serve` compiles a `response_format` JSON schema: in this process
(`worker.compile_key`: seconds and the compiled grammar's size, xgrammar's
`memory_size_bytes`), the hand-back a compile worker adds (the grammar serialized to JSON
and read back), and through `CompileWorkers` (the killable worker processes: wall seconds
from submit to a usable grammar). `--max-whitespace-cnt N` compiles with xgrammar's
in-grammar whitespace cap instead, what pagemill did before its cap moved beside the
grammar (`whitespace.WhitespaceCap`); the workers run pagemill's own compile, so that mode
reports the hand-back only. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def schema(n: int) -> dict[str, Any]:
    item = {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}},
        "required": ["x", "y"],
    }
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "array", "items": item}]
    props = {f"field_{i}": kinds[i % 3] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model folder with a tokenizer (default: the default model)")
    ap.add_argument("--sizes", default="2,6,12", help="properties per schema")
    ap.add_argument("--max-whitespace-cnt", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60.0, help="worker compile deadline (s)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import transformers
    import xgrammar as xgr

    from pagemill.runtime.sample.structured_output import worker
    from pagemill.runtime.sample.structured_output.worker import CompileWorkers

    if args.model is None:
        from pagemill.runtime.model_executor.default_model import ensure_default_model

        folder = str(ensure_default_model())
    else:
        folder = args.model
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=config.vocab_size)
    cap = args.max_whitespace_cnt

    def compile_in_process(compiler: Any, key: Any) -> Any:
        if cap is None:
            return worker.compile_key(compiler, key)
        return compiler.compile_json_schema(key[1], any_whitespace=True, max_whitespace_cnt=cap)

    # The workers run pagemill's own compile (a separate process imports it): with
    # --max-whitespace-cnt their hand-back is estimated here, as serialize + deserialize.
    workers = None
    if cap is None:
        workers = CompileWorkers(info, num_workers=1, timeout=args.timeout, cache_limit_bytes=0)
        workers.submit(("regex", "[ab]+")).future.result(timeout=300)  # workers up
    rows = []
    try:
        for n in map(int, args.sizes.split(",")):
            key = ("json", json.dumps(schema(n)))
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=0)
            t = time.perf_counter()
            compiled = compile_in_process(compiler, key)
            in_process = time.perf_counter() - t
            t = time.perf_counter()
            text = compiled.serialize_json()
            xgr.CompiledGrammar.deserialize_json(text, info)
            hand_back = time.perf_counter() - t
            row: dict[str, Any] = {
                "properties": n,
                "compile_s": round(in_process, 3),
                "grammar_mb": round(compiled.memory_size_bytes / 1e6, 2),
                "serialized_mb": round(len(text) / 1e6, 2),
                "serialize_deserialize_s": round(hand_back, 3),
            }
            if workers is not None:
                t = time.perf_counter()
                try:
                    workers.submit(key).future.result(timeout=args.timeout * 4 + 60)
                    row["through_workers_s"] = round(time.perf_counter() - t, 3)
                except Exception as exc:
                    row["through_workers_s"] = f"{type(exc).__name__} ({exc})"
            rows.append(row)
            print(row, flush=True)
    finally:
        if workers is not None:
            workers.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"max_whitespace_cnt": cap, "vocab": config.vocab_size, "rows": rows}, f, indent=2
            )


if __name__ == "__main__":
    main()
