"""Shared by the server tests: a tiny real model, servers on loopback, and the pieces to put
an engine-core double behind the real front end (`CoreDouble`, `front_end`)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello server, hello paged attention",
    "streaming tokens to clients over server sent events",
] * 4
BLOCK_SIZE = 16


def build_tiny_llama(
    folder: Path,
    max_len: int = 1024,
    *,
    corpus: Sequence[str] = CORPUS,
    vocab_size: int = 300,
    extra_special: Sequence[str] = ("<|im_start|>",),
    chat_template: str = CHAT_TEMPLATE,
) -> None:
    """A 2-layer random Llama with a trained BPE tokenizer (`<eos>` and `extra_special` as
    special tokens), saved like a real checkpoint."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        list(corpus),
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<eos>", *extra_special],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", additional_special_tokens=list(extra_special)
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        initializer_range=0.2,
        eos_token_id=fast.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(folder))


def engine_kwargs(folder: Path, num_blocks: int = 64, max_model_len: int = 256) -> dict[str, Any]:
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 16 x 4 bytes per token.
    return dict(
        model=str(folder),
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=num_blocks * BLOCK_SIZE * 2 * 2 * 2 * 16 * 4,
        max_num_batched_tokens=512,
        max_model_len=max_model_len,
    )


class CoreDouble:
    """The `EngineCore` surface a client drives, for doubles that script what a core does:
    subclasses define `add_request`, `abort_requests`, `has_unfinished_requests` and `step`
    (returning `EngineCoreOutputs`). `max_model_len` and the pool size are what the core
    reports when it is ready."""

    max_model_len = 1024
    num_blocks = 1
    block_size = BLOCK_SIZE

    def ready_message(self) -> Any:
        from pagemill.runtime.engine.protocol import EngineCoreReady

        return EngineCoreReady(
            self.max_model_len, self.num_blocks, self.block_size, "float32", "cpu", os.getpid()
        )

    def get_stats(self) -> Any:
        from pagemill.runtime.engine.protocol import SchedulerStats

        return SchedulerStats(num_blocks=self.num_blocks, block_size=self.block_size)

    def on_worker_failure(self, handler: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def toy_assets(
    vocab_size: int = 1000, eos_token_ids: Sequence[int] = (0,), tokenizer: Any = None
) -> Any:
    """`ModelAssets` for a core double: no folder, no tokenizer (token-id prompts only)."""
    from pagemill.runtime.engine.model_assets import ModelAssets

    model_config = SimpleNamespace(vocab_size=vocab_size, eos_token_ids=list(eos_token_ids))
    return ModelAssets(Path("."), model_config, tokenizer, {})  # type: ignore[arg-type]


def front_end(core: Any, *, assets: Any = None, client_cls: Any = None, **kwargs: Any) -> Any:
    """The server's real front end (`AsyncEngine`) over `core` on its own thread
    (a `ThreadedClient`, or `client_cls`)."""
    from pagemill.runtime.engine.core_client import ThreadedClient
    from pagemill.server import AsyncEngine

    client = (client_cls or ThreadedClient)(core)
    return AsyncEngine(
        client=client, assets=assets if assets is not None else toy_assets(), **kwargs
    )


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ServeThread:
    """`shutdown.serve` on a thread (no signals there), on a socket bound here."""

    def __init__(self, app: Any, client: Any, **kwargs: Any) -> None:
        self.sock = free_socket()
        port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.code: int | None = None
        self.error: BaseException | None = None

        def run() -> None:
            from pagemill.server.entrypoints.shutdown import serve

            try:
                self.code = serve(
                    app,
                    client,
                    host="127.0.0.1",
                    port=port,
                    log_level="warning",
                    sockets=[self.sock],
                    **kwargs,
                )
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)

    def __enter__(self) -> ServeThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return self
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def wait(self, timeout: float) -> int | None:
        self.thread.join(timeout)
        return self.code

    def __exit__(self, *exc: object) -> None:
        from pagemill.server.entrypoints import shutdown

        server = shutdown.LAST_SERVER
        if server is not None and self.thread.is_alive():
            server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def raw_socket(port: int, timeout: float = 5.0) -> Iterator[socket.socket]:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        yield s
    finally:
        s.close()


def closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `s` (recv gives b'' or a reset), None if it did not."""
    start = time.monotonic()
    s.settimeout(seconds)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return time.monotonic() - start
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - start
    except TimeoutError:
        return None
