"""The `vllm serve` flags pagemill does not implement, each with why.

pagemill's parser (cli.py, vllm_args.py) takes every vLLM flag whose feature pagemill has,
under vLLM's spelling. This module covers the rest of vLLM's serve flags (read from vLLM's
`EngineArgs.add_cli_args` and `FrontendArgs`), so that a vLLM command line either starts
pagemill or stops in one line naming the flag pagemill cannot honour, instead of an
argparse "unrecognized arguments" dump or, worse, a flag taken and silently ignored:

- a flag set to a value that asks for what pagemill does anyway (`--pipeline-parallel-size
  1`, `--tokenizer-mode auto`, `--lora-dtype auto`) is accepted and changes nothing;
- any other use is refused: "pagemill: --fully-sharded-loras (a vLLM flag) is not supported: ...",
  exit code 2.

Standard library only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["REFUSED", "RUN_BATCH_REFUSED", "VllmFlag", "add_vllm_flags", "refuse"]


def refuse(flag: str, why: str) -> NoReturn:
    """Stop with vLLM-flag refusal's one line and argparse's exit code."""
    sys.stderr.write(f"pagemill: {flag} (a vLLM flag) is not supported: {why}\n")
    raise SystemExit(2)


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag pagemill recognises but does not implement.

    `kind`: "switch" (a vLLM boolean, `--x` / `--no-x`), "value" (one value) or "values"
    (one or more). `neutral`: the values (for a switch, "on" or "off") that ask for what
    pagemill does anyway, accepted as no-ops; vLLM's default for a switch usually is one.
    """

    flags: tuple[str, ...]
    why: str
    kind: str = "value"
    neutral: tuple[str, ...] = ()


_MM = "pagemill serves text-only models"
_DP = "pagemill runs its data-parallel cores on one machine (--data-parallel-size only)"
_MOE = "pagemill has no expert parallelism"
_SPEC = "lookahead slots are vLLM's older speculation knob: use --speculative-config"
_DISAGG = "pagemill has no KV transfer"
_TLS = "pagemill serves plain HTTP; put a TLS-terminating proxy in front"
_CODE = "pagemill loads no code by name"
_CUDA_GRAPH = "pagemill's GPU path has no CUDA-graph capture settings"
_MAMBA = "pagemill serves no Mamba/hybrid models"


def _switch(flag: str, why: str, default_on: bool = False) -> VllmFlag:
    return VllmFlag((flag,), why, "switch", ("on",) if default_on else ("off",))


REFUSED: tuple[VllmFlag, ...] = (
    # ---- ModelConfig
    # --runner, --convert and --pooler-config are pagemill's own (EngineConfig) flags.
    VllmFlag(
        ("--task",),
        "vLLM's older name: use --runner pooling or --convert embed",
        neutral=("auto", "generate"),
    ),
    VllmFlag(("--tokenizer-mode",), "pagemill uses the Hugging Face tokenizer", neutral=("auto",)),
    VllmFlag(("--hf-config-path",), "the model folder's config.json is used"),
    VllmFlag(("--allowed-local-media-path",), _MM),
    VllmFlag(("--allowed-media-domains",), _MM, "values"),
    VllmFlag(("--code-revision",), "pagemill runs no remote model code"),
    VllmFlag(("--rope-scaling",), "RoPE settings come from the model's config.json"),
    VllmFlag(("--rope-theta",), "RoPE settings come from the model's config.json"),
    VllmFlag(("--tokenizer-revision",), "the tokenizer comes from --revision or --tokenizer"),
    VllmFlag(
        ("--logprobs-mode",),
        "logprobs are always of the raw (unprocessed) logits",
        neutral=("raw_logprobs",),
    ),
    _switch("--disable-sliding-window", "sliding windows follow the model's config"),
    # Turning off what pagemill does not have is honoured as it stands.
    VllmFlag(("--disable-cascade-attn",), "", "switch", ("on", "off")),
    _switch("--skip-tokenizer-init", "the API server owns the tokenizer"),
    _switch("--enable-prompt-embeds", "prompts are text or token ids"),
    VllmFlag(("--config-format",), "pagemill reads Hugging Face configs", neutral=("auto", "hf")),
    VllmFlag(("--hf-overrides",), "the model's config.json is used as it is"),
    VllmFlag(("--override-pooler-config",), "vLLM's older name: use --pooler-config"),
    VllmFlag(("--logits-processor-pattern",), _CODE),
    VllmFlag(("--logits-processors",), _CODE, "values"),
    _switch("--enable-sleep-mode", "pagemill has no sleep mode"),
    VllmFlag(("--model-impl",), "pagemill has its own model code", neutral=("auto", "vllm")),
    VllmFlag(("--override-attention-dtype",), "attention runs in the compute dtype"),
    VllmFlag(("--io-processor-plugin",), _CODE),
    # ---- LoadConfig
    VllmFlag(
        ("--safetensors-load-strategy",), "pagemill has one safetensors loader", neutral=("lazy",)
    ),
    VllmFlag(("--model-loader-extra-config",), "pagemill has no loader options"),
    VllmFlag(("--ignore-patterns",), "pagemill downloads only the files it reads", "values"),
    _switch("--use-tqdm-on-load", "pagemill shows no load progress bar", default_on=True),
    VllmFlag(("--pt-load-map-location",), "pagemill reads safetensors and GGUF, not .pt files"),
    # ---- StructuredOutputsConfig (--reasoning-parser is pagemill's own)
    VllmFlag(("--guided-decoding-backend",), "pagemill has one structured-output backend"),
    VllmFlag(("--guided-decoding-disable-fallback",), "pagemill has one structured-output backend"),
    VllmFlag(("--guided-decoding-disable-any-whitespace",), "see pagemill's JSON whitespace cap"),
    VllmFlag(("--guided-decoding-disable-additional-properties",), "schemas are taken as written"),
    VllmFlag(
        ("--structured-outputs-config",),
        "use --structured-outputs-compile-timeout and the other --structured-outputs-* flags",
    ),
    # ---- ParallelConfig
    VllmFlag(
        ("--distributed-executor-backend",),
        "tensor-parallel ranks are processes pagemill starts itself (or torchrun)",
        neutral=("mp",),
    ),
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        "pipeline parallelism is not implemented (use --tensor-parallel-size)",
        neutral=("1",),
    ),
    VllmFlag(
        ("--decode-context-parallel-size", "-dcp"),
        "context parallelism is not implemented",
        neutral=("1",),
    ),
    VllmFlag(("--data-parallel-rank", "-dpn"), _DP),
    VllmFlag(("--data-parallel-start-rank", "-dpr"), _DP),
    VllmFlag(("--data-parallel-size-local", "-dpl"), _DP),
    VllmFlag(("--data-parallel-address", "-dpa"), _DP),
    VllmFlag(("--data-parallel-rpc-port", "-dpp"), _DP),
    VllmFlag(("--data-parallel-backend", "-dpb"), _DP),
    _switch("--data-parallel-hybrid-lb", _DP),
    _switch("--data-parallel-external-lb", _DP),
    _switch("--data-parallel-multi-port-external-lb", _DP),
    VllmFlag(("--data-parallel-supervisor-port",), _DP),
    VllmFlag(("--dp-supervisor-probe-interval-s",), _DP),
    VllmFlag(("--dp-supervisor-probe-timeout-s",), _DP),
    VllmFlag(("--dp-supervisor-probe-failure-threshold",), _DP),
    _switch("--enable-expert-parallel", _MOE),
    VllmFlag(("--all2all-backend",), _MOE),
    _switch("--enable-dbo", "dual-batch overlap is not implemented"),
    VllmFlag(("--dbo-decode-token-threshold",), "dual-batch overlap is not implemented"),
    VllmFlag(("--dbo-prefill-token-threshold",), "dual-batch overlap is not implemented"),
    _switch("--disable-nccl-for-dp-synchronization", _DP),
    _switch("--enable-eplb", _MOE),
    VllmFlag(("--eplb-config",), _MOE),
    VllmFlag(("--expert-placement-strategy",), _MOE),
    VllmFlag(("--num-redundant-experts",), _MOE),
    VllmFlag(("--eplb-window-size",), _MOE),
    VllmFlag(("--eplb-step-interval",), _MOE),
    _switch("--eplb-log-balancedness", _MOE),
    VllmFlag(("--max-parallel-loading-workers",), "each rank loads its own shard"),
    _switch("--ray-workers-use-nsight", "pagemill does not use Ray"),
    VllmFlag(("--disable-custom-all-reduce",), "", "switch", ("on", "off")),
    VllmFlag(("--worker-cls",), _CODE),
    VllmFlag(("--worker-extension-cls",), _CODE),
    _switch("--enable-multimodal-encoder-data-parallel", _MM),
    # ---- CacheConfig
    VllmFlag(
        ("--swap-space",), "preempted requests are recomputed, never swapped to CPU", neutral=("0",)
    ),
    VllmFlag(("--num-gpu-blocks-override",), "size the pool with --kv-cache-memory-bytes"),
    VllmFlag(("--cpu-offload-gb",), "weights are not offloaded", neutral=("0",)),
    _switch("--kv-sharing-fast-prefill", "pagemill shares no KV between layers"),
    VllmFlag(("--mamba-cache-dtype",), _MAMBA, neutral=("auto",)),
    VllmFlag(("--mamba-ssm-cache-dtype",), _MAMBA, neutral=("auto",)),
    VllmFlag(("--mamba-block-size",), _MAMBA),
    # ---- MultiModalConfig
    VllmFlag(("--limit-mm-per-prompt",), _MM),
    _switch("--enable-mm-embeds", _MM),
    VllmFlag(("--media-io-kwargs",), _MM),
    VllmFlag(("--mm-processor-kwargs",), _MM),
    VllmFlag(("--mm-processor-cache-gb",), _MM),
    _switch("--disable-mm-preprocessor-cache", _MM),
    VllmFlag(("--mm-processor-cache-type",), _MM),
    VllmFlag(("--mm-shm-cache-max-object-size-mb",), _MM),
    VllmFlag(("--mm-encoder-tp-mode",), _MM),
    VllmFlag(("--mm-encoder-attn-backend",), _MM),
    _switch("--interleave-mm-strings", _MM),
    _switch("--skip-mm-profiling", _MM),
    VllmFlag(("--video-pruning-rate",), _MM),
    # ---- LoRAConfig (--enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras and
    # --lora-modules are pagemill's own flags)
    VllmFlag(("--lora-extra-vocab-size",), "pagemill's LoRA adapters add no vocabulary"),
    VllmFlag(("--lora-dtype",), "LoRA adapters run in the model's dtype", neutral=("auto",)),
    _switch("--fully-sharded-loras", "LoRA is single-device (no tensor parallelism) for now"),
    VllmFlag(("--default-mm-loras",), _MM),
    # ---- ObservabilityConfig
    VllmFlag(("--show-hidden-metrics-for-version",), "pagemill hides no metrics"),
    VllmFlag(("--otlp-traces-endpoint",), "pagemill exports no OpenTelemetry traces"),
    VllmFlag(("--collect-detailed-traces",), "pagemill exports no OpenTelemetry traces"),
    # ---- SchedulerConfig
    VllmFlag(("--max-num-partial-prefills",), "one prompt is chunked at a time", neutral=("1",)),
    VllmFlag(("--max-long-partial-prefills",), "one prompt is chunked at a time", neutral=("1",)),
    VllmFlag(("--num-lookahead-slots",), _SPEC, neutral=("0",)),
    VllmFlag(("--scheduler-cls",), _CODE),
    VllmFlag(("--external-parameters",), "pagemill's scheduler takes no external parameters"),
    _switch("--disable-chunked-mm-input", _MM),
    VllmFlag(("--disable-hybrid-kv-cache-manager",), "", "switch", ("on", "off")),
    _switch("--async-scheduling", "each step is scheduled after the previous one's output"),
    # ---- CompilationConfig (-O / --compilation-config are pagemill's own)
    VllmFlag(("--cudagraph-capture-sizes",), _CUDA_GRAPH, "values"),
    VllmFlag(("--cuda-graph-sizes",), _CUDA_GRAPH, "values"),
    VllmFlag(("--max-cudagraph-capture-size",), _CUDA_GRAPH),
    # ---- VllmConfig
    VllmFlag(("--kv-transfer-config",), _DISAGG),
    VllmFlag(("--additional-config",), "pagemill has no platform plugins"),
    _switch("--aggregate-engine-logging", _DP),
    # ---- the serve command and its front end
    _switch("--headless", _DP),
    VllmFlag(
        ("--api-server-count", "-asc"), "one API server process serves the engine", neutral=("1",)
    ),
    _switch("--grpc", "pagemill serves HTTP only"),
    VllmFlag(
        ("--chat-template-content-format",),
        "message content is rendered as the template expects",
        neutral=("auto",),
    ),
    _switch("--trust-request-chat-template", "requests cannot bring their own chat template"),
    VllmFlag(("--default-chat-template-kwargs",), "chat-template keywords come from requests"),
    VllmFlag(("--response-role",), "the reply's role is assistant", neutral=("assistant",)),
    _switch("--return-tokens-as-token-ids", "logprob tokens are returned as text"),
    _switch("--exclude-tools-when-tool-choice-none", "tools are rendered whenever given"),
    VllmFlag(("--tool-parser-plugin",), _CODE),
    VllmFlag(("--tool-server",), "pagemill runs no built-in tools"),
    VllmFlag(("--log-config-file",), "use --log-level and --uvicorn-log-level"),
    _switch("--enable-prompt-tokens-details", "not implemented by this front end"),
    _switch("--enable-per-request-metrics", "per-request timings are in /metrics only"),
    _switch("--enable-server-load-tracking", "see /metrics (vllm:num_requests_running)"),
    _switch("--enable-force-include-usage", "usage is sent as each request asks"),
    _switch("--enable-tokenizer-info-endpoint", "there is no /tokenizer_info endpoint"),
    _switch("--enable-log-outputs", "outputs are not logged"),
    _switch("--enable-log-deltas", "outputs are not logged", default_on=True),
    _switch("--cohere-is-reasoning-model", "there is no Cohere endpoint", default_on=True),
    VllmFlag(("--cohere-format",), "there is no Cohere endpoint"),
    _switch("--log-error-stack", "server-side errors are logged with their stack already"),
    _switch("--tokens-only", "every endpoint is served"),
    VllmFlag(("--fingerprint-mode",), "responses carry no system_fingerprint"),
    VllmFlag(("--fingerprint-value",), "responses carry no system_fingerprint"),
    VllmFlag(("--uds",), "pagemill listens on TCP (--host, --port)"),
    _switch("--disable-uvicorn-access-log", "use --uvicorn-log-level warning"),
    VllmFlag(("--disable-access-log-for-endpoints",), "use --uvicorn-log-level warning"),
    VllmFlag(("--ssl-keyfile",), _TLS),
    VllmFlag(("--ssl-certfile",), _TLS),
    VllmFlag(("--ssl-ca-certs",), _TLS),
    _switch("--enable-ssl-refresh", _TLS),
    VllmFlag(("--ssl-cert-reqs",), _TLS),
    VllmFlag(("--ssl-ciphers",), _TLS),
    VllmFlag(("--root-path",), "serve it at the root and let the proxy rewrite paths"),
    VllmFlag(("--middleware",), _CODE),
    _switch("--enable-request-id-headers", "no X-Request-Id header is added"),
    _switch("--disable-fastapi-docs", "/openapi.json is always served"),
    VllmFlag(("--h11-max-incomplete-event-size",), "use --header-timeout / --max-body-size"),
    VllmFlag(("--h11-max-header-count",), "use --header-timeout / --max-body-size"),
    _switch("--enable-offline-docs", "pagemill serves no documentation pages"),
    _switch("--enable-flash-late-interaction", "pagemill has no scoring endpoint", default_on=True),
)


# `vllm run-batch`'s own flags, besides serve's.
RUN_BATCH_REFUSED: tuple[VllmFlag, ...] = (
    _switch("--enable-metrics", "run-batch serves no /metrics; `pagemill serve` does"),
    VllmFlag(("--url",), "run-batch serves no /metrics; `pagemill serve` does"),
    VllmFlag(("--port",), "run-batch serves no /metrics; `pagemill serve` does"),
    VllmFlag(("--output-tmp-dir",), "results are written next to --output-file, then renamed"),
    VllmFlag(
        ("--lora-modules",),
        "run-batch names no LoRA adapters yet; `pagemill serve --lora-modules` does",
        "values",
    ),
)


class _RefusedAction(argparse.Action):
    """Accepts the neutral uses of a vLLM flag (they change nothing) and refuses the rest."""

    def __init__(self, *args: Any, vllm: VllmFlag, form: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vllm = vllm
        self.form = form  # "on" / "off" for the two spellings of a switch

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag = option_string or self.vllm.flags[0]
        if self.vllm.kind == "switch":
            if self.form in self.vllm.neutral:
                return
            refuse(flag, self.vllm.why)
        given = [values] if isinstance(values, str) else list(values)
        if len(given) == 1 and given[0] in self.vllm.neutral:
            return
        accepted = f" (accepted: {', '.join(self.vllm.neutral)})" if self.vllm.neutral else ""
        refuse(f"{flag} {' '.join(given)}", self.vllm.why + accepted)


def add_vllm_flags(parser: argparse.ArgumentParser, extra: Sequence[VllmFlag] = ()) -> None:
    """Teach `parser` every vLLM flag of `REFUSED` (and `extra`) it does not already have.

    Flags the parser already defines (pagemill implements them, or later grows them) are
    left alone, so a flag moves from refused to implemented by being added to the parser.
    Hidden from --help: the README lists them.
    """
    known = set(parser._option_string_actions)
    for entry in (*REFUSED, *extra):
        spellings = [f for f in entry.flags if f not in known]
        if not spellings or entry.flags[0] not in spellings:
            continue
        dest = "_vllm_" + entry.flags[0].lstrip("-").replace("-", "_")
        if entry.kind == "switch":
            for form, spelling in (("on", entry.flags[0]), ("off", "--no-" + entry.flags[0][2:])):
                if spelling in known:
                    continue
                parser.add_argument(
                    spelling,
                    nargs=0,
                    dest=dest,
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                    action=_RefusedAction,
                    vllm=entry,
                    form=form,
                )
            continue
        parser.add_argument(
            *spellings,
            nargs="+" if entry.kind == "values" else None,
            dest=dest,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            action=_RefusedAction,
            vllm=entry,
            form="",
        )
