"""`pagemill serve`'s start order: the engine-core process first, the heavy imports after.

The core's start (torch, the model, the compiled step) is the long pole of a warm start,
so the API process starts it before importing torch, the engine's front end or the server,
and the core loads its grammars' tokenizer and xgrammar only once it is up. A tiny random
Llama with a trained BPE tokenizer.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import build_tiny_llama, engine_kwargs

from pagemill.runtime import SamplingParams, StructuredOutputsParams
from pagemill.runtime.sampling_params import RequestOutputKind
from pagemill.server import AsyncEngine

# Run as a script: records what the server process had imported when it started the core,
# then ends the process there (the core is never built).
PROBE = """
import os, sys
import multiprocessing.process as mpp

def start(self):
    heavy = [m for m in ("torch", "transformers", "xgrammar", "fastapi") if m in sys.modules]
    print("spawned after", heavy, flush=True)
    os._exit(0)

mpp.BaseProcess.start = start
from pagemill.server.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("start-order-llama")
    build_tiny_llama(folder)
    return folder


def test_serve_starts_the_core_before_importing_torch_or_the_server(model_dir: Path) -> None:
    args = ["serve", str(model_dir), "--device", "cpu", "--port", "8765"]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=300
    )
    assert "spawned after []" in out.stdout, out.stdout + out.stderr


def test_a_grammar_through_an_engine_process(model_dir: Path) -> None:
    """The core process builds its grammars' tokenizer after its start; the first
    constrained request still gets an answer the grammar allows."""
    client = AsyncEngine.launch(**engine_kwargs(model_dir), enforce_eager=True)
    params = SamplingParams(
        max_tokens=16,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["hello world", "low"]),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def main() -> str:
        q = await client.add_request("g", [5, 6, 7], params)
        outs = [out async for out in client.stream(q, ["g"])]
        assert outs[-1].finished
        return outs[-1].outputs[0].text

    try:
        assert asyncio.run(asyncio.wait_for(main(), timeout=300)) in ("hello world", "low")
    finally:
        client.shutdown()
