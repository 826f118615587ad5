"""`pagemill serve` takes `vllm serve`'s command line: vLLM's flags for pagemill's features,
its --config YAML, and a one-line refusal (exit 2) for every other vLLM flag."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from pagemill.runtime.config import EngineConfig
from pagemill.server import cli, vllm_args
from pagemill.server.vllm_refused import REFUSED

# vLLM's `vllm serve` flags, as its EngineArgs.add_cli_args, AsyncEngineArgs, FrontendArgs
# and make_arg_parser define them (vLLM 0.11-0.12), written out here rather than taken from
# pagemill's table so that a flag the table misses fails this test.
VLLM_SERVE_FLAGS = """
--model --runner --convert --task --tokenizer --tokenizer-mode --trust-remote-code --dtype
--seed --hf-config-path --allowed-local-media-path --allowed-media-domains --revision
--code-revision --rope-scaling --rope-theta --tokenizer-revision --max-model-len
--quantization -q --enforce-eager --max-logprobs --logprobs-mode --disable-sliding-window
--disable-cascade-attn --skip-tokenizer-init --enable-prompt-embeds --served-model-name
--config-format --hf-token --hf-overrides --pooler-config --override-pooler-config
--logits-processor-pattern --generation-config --override-generation-config
--enable-sleep-mode --model-impl --override-attention-dtype --logits-processors
--io-processor-plugin --load-format --download-dir --safetensors-load-strategy
--model-loader-extra-config --ignore-patterns --use-tqdm-on-load --pt-load-map-location
--guided-decoding-backend --guided-decoding-disable-fallback
--guided-decoding-disable-any-whitespace --guided-decoding-disable-additional-properties
--distributed-executor-backend --pipeline-parallel-size -pp --tensor-parallel-size -tp
--decode-context-parallel-size -dcp --data-parallel-size -dp --data-parallel-rank -dpn
--data-parallel-start-rank -dpr --data-parallel-size-local -dpl --data-parallel-address -dpa
--data-parallel-rpc-port -dpp --data-parallel-backend -dpb --data-parallel-hybrid-lb
--enable-expert-parallel --all2all-backend --enable-dbo --dbo-decode-token-threshold
--dbo-prefill-token-threshold --disable-nccl-for-dp-synchronization --enable-eplb
--eplb-config --expert-placement-strategy --num-redundant-experts --eplb-window-size
--eplb-step-interval --eplb-log-balancedness --max-parallel-loading-workers
--ray-workers-use-nsight --disable-custom-all-reduce --worker-cls --worker-extension-cls
--enable-multimodal-encoder-data-parallel --block-size --gpu-memory-utilization
--kv-cache-memory-bytes --swap-space --kv-cache-dtype --num-gpu-blocks-override
--enable-prefix-caching --prefix-caching-hash-algo --cpu-offload-gb --calculate-kv-scales
--kv-sharing-fast-prefill --mamba-cache-dtype --mamba-ssm-cache-dtype --mamba-block-size
--limit-mm-per-prompt --enable-mm-embeds --media-io-kwargs --mm-processor-kwargs
--mm-processor-cache-gb --disable-mm-preprocessor-cache --mm-processor-cache-type
--mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode --mm-encoder-attn-backend
--interleave-mm-strings --skip-mm-profiling --video-pruning-rate --enable-lora --max-loras
--max-lora-rank --lora-extra-vocab-size --lora-dtype --max-cpu-loras --fully-sharded-loras
--default-mm-loras --show-hidden-metrics-for-version --otlp-traces-endpoint
--collect-detailed-traces --max-num-batched-tokens --max-num-seqs --max-num-partial-prefills
--max-long-partial-prefills --long-prefill-token-threshold --num-lookahead-slots
--scheduling-policy --enable-chunked-prefill --disable-chunked-mm-input --scheduler-cls
--disable-hybrid-kv-cache-manager --async-scheduling --cudagraph-capture-sizes
--cuda-graph-sizes --max-cudagraph-capture-size --speculative-config --kv-transfer-config
--kv-events-config --compilation-config -O --additional-config --structured-outputs-config
--disable-log-stats --aggregate-engine-logging --enable-log-requests --disable-log-requests
--headless --api-server-count -asc --config --grpc
--lora-modules --chat-template --chat-template-content-format --trust-request-chat-template
--default-chat-template-kwargs --response-role --return-tokens-as-token-ids
--enable-auto-tool-choice --exclude-tools-when-tool-choice-none --tool-call-parser
--tool-parser-plugin --tool-server --log-config-file --max-log-len
--enable-prompt-tokens-details --enable-per-request-metrics --enable-server-load-tracking
--enable-force-include-usage --enable-tokenizer-info-endpoint --enable-log-outputs
--enable-log-deltas --log-error-stack --tokens-only --host --port --uds --uvicorn-log-level
--disable-uvicorn-access-log --disable-access-log-for-endpoints --allow-credentials
--allowed-origins --allowed-methods --allowed-headers --api-key --ssl-keyfile --ssl-certfile
--ssl-ca-certs --enable-ssl-refresh --ssl-cert-reqs --ssl-ciphers --root-path --middleware
--enable-request-id-headers --disable-fastapi-docs --h11-max-incomplete-event-size
--h11-max-header-count --enable-offline-docs
""".split()  # noqa: SIM905 (one line per group of vLLM's flags reads better than a list)
# Owned by pagemill's tool-calling and reasoning work, not by this command line.
NOT_HERE = {"--reasoning-parser"}

# A typical command line from vLLM's docs and deployment guides.
VLLM_DOCS_LINE = [
    "serve",
    "Qwen/Qwen2.5-1.5B-Instruct",
    "--host",
    "127.0.0.1",
    "--port",
    "8000",
    "--served-model-name",
    "qwen",
    "--max-model-len",
    "32k",
    "--gpu-memory-utilization",
    "0.9",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--trust-remote-code",
    "--disable-log-requests",
    "--dtype",
    "half",
    "--max-num-seqs",
    "64",
    "--tensor-parallel-size",
    "1",
    "--pipeline-parallel-size",
    "1",
    "--kv-cache-dtype",
    "auto",
    "--enable-prefix-caching",
    "--uvicorn-log-level",
    "warning",
    "--max-logprobs",
    "5",
    "--seed",
    "7",
]


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.parse_args(argv)


def serve_options() -> set[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices["serve"]._option_string_actions)


def test_every_vllm_serve_flag_is_recognised() -> None:
    known = serve_options()
    missing = [f for f in VLLM_SERVE_FLAGS if f not in known and f not in NOT_HERE]
    assert missing == []


def test_vllm_docs_command_line() -> None:
    args = parse(VLLM_DOCS_LINE)
    config = cli.engine_config(args)
    assert config == EngineConfig.from_kwargs(
        model="Qwen/Qwen2.5-1.5B-Instruct",
        max_model_len=32000,
        gpu_memory_utilization=0.9,
        dtype="float16",
        max_num_seqs=64,
        enable_prefix_caching=True,
        max_logprobs=5,
        seed=7,
    )
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 8000, ["qwen"])
    assert args.enable_auto_tool_choice and args.trust_remote_code
    assert args.tool_call_parser == "hermes" and not vllm_args.log_requests(args)
    assert args.uvicorn_log_level == "warning"


def test_vllm_spellings_and_values() -> None:
    def config(*argv: str) -> EngineConfig:
        return cli.engine_config(parse(["serve", "/m", *argv]))

    assert config("--max_model_len", "4K").max_model_len == 4096  # FlexibleArgumentParser
    assert config("--max-num-batched-tokens=1k").scheduler.max_num_batched_tokens == 1000
    assert config("-q", "int8").quantization == "int8"
    assert config("-O0").enforce_eager and config("-O", "0").enforce_eager
    assert config("--compilation-config", '{"level": 0}').enforce_eager
    assert not config("-O3").enforce_eager and not config("-O", '{"mode": 3}').enforce_eager
    assert config("-O.level=0").enforce_eager and not config("-O.level=2").enforce_eager
    assert config("--override-generation-config", '{"temperature": 0.2}') == EngineConfig(
        model="/m", override_generation_config={"temperature": 0.2}
    )
    assert config("--max-logprobs", "-1").max_logprobs == 20
    args = parse(["serve", "--enable-log-requests", "--max-log-len", "9", "--hf-token"])
    assert vllm_args.log_requests(args) and args.max_log_len == 9 and args.hf_token is True
    assert vllm_args.log_requests(parse(["serve", "--no-disable-log-requests"]))
    assert not vllm_args.log_requests(parse(["serve"]))
    assert parse(["serve", "--hf-token", "hf_x"]).hf_token == "hf_x"
    assert parse(["serve", "--download-dir", "/d"]).download_dir == "/d"


def test_api_key_variables() -> None:
    assert cli.resolve_api_key(None, {"VLLM_API_KEY": "v"}) == "v"
    assert cli.resolve_api_key(None, {"VLLM_API_KEY": "v", "PAGEMILL_API_KEY": "p"}) == "p"
    assert cli.resolve_api_key("f", {"VLLM_API_KEY": "v"}) == "f"
    assert cli.resolve_api_key(None, {"VLLM_API_KEY": ""}) is None
    assert parse(["serve", "--api-key", "k"]).api_key == "k"


def test_cors_off_unless_asked() -> None:
    assert vllm_args.cors_settings(parse(["serve"])) is None
    got = vllm_args.cors_settings(parse(["serve", "--allowed-origins", '["https://a.example"]']))
    assert got == {
        "allow_origins": ["https://a.example"],
        "allow_methods": ["*"],
        "allow_headers": ["*"],
        "allow_credentials": False,
    }
    assert vllm_args.cors_settings(parse(["serve", "--allow-credentials"]))["allow_credentials"]


def _refusal_argv(flag: str, entry_kind: str, neutral: tuple[str, ...]) -> list[str]:
    if entry_kind == "switch":
        form = "off" if "off" not in neutral else "on"
        return [flag if form == "on" else "--no-" + flag[2:]]
    return [flag, "surely-not-neutral"]


@pytest.mark.parametrize(
    "entry",
    [e for e in REFUSED if e.neutral != ("on", "off")],
    ids=lambda e: e.flags[0],
)
def test_other_vllm_flags_are_refused_in_one_line(
    entry, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _refusal_argv(entry.flags[0], entry.kind, entry.neutral)
    with pytest.raises(SystemExit) as exc:
        parse(["serve", "/m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"pagemill: {argv[0]}") and "(a vLLM flag) is not supported: " in err


@pytest.mark.parametrize("entry", [e for e in REFUSED if e.neutral], ids=lambda e: e.flags[0])
def test_neutral_uses_of_vllm_flags_change_nothing(entry) -> None:
    for value in entry.neutral:
        if entry.kind == "switch":
            argv = [entry.flags[0] if value == "on" else "--no-" + entry.flags[0][2:]]
        else:
            argv = [entry.flags[0], value]
        args = parse(["serve", "/m", *argv])
        assert cli.engine_config(args) == EngineConfig(model="/m")


def test_refusal_names_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, text in (
        (["--kv-cache-dtype", "int4"], "pagemill serve: error: argument --kv-cache-dtype"),
        (["-pp", "2"], "pagemill: -pp 2 (a vLLM flag) is not supported: pipeline"),
        (
            ["--fully-sharded-loras"],
            "pagemill: --fully-sharded-loras (a vLLM flag) is not supported: ",
        ),
        (["--api-key", "a", "b"], "pagemill: --api-key with several keys"),
        (
            ["-O", '{"level": 3, "cudagraph_capture_sizes": [1]}'],
            "pagemill: --compilation-config cudagraph_capture_sizes (a vLLM flag)",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(["serve", *argv])
        assert exc.value.code == 2
        assert capsys.readouterr().err.startswith(text), argv


def test_kv_cache_dtype_is_a_cache_option() -> None:
    args = parse(["serve", "/m", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    cache = cli.engine_config(args).cache
    assert (cache.kv_cache_dtype, cache.calculate_kv_scales) == ("fp8", True)
    args = parse(["serve", "/m", "--kv-cache-dtype", "fp8_e5m2"])
    assert cli.engine_config(args).cache.kv_cache_dtype == "fp8_e5m2"


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["serve", "--block-size", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--block-size" in err


def test_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "model: /from/file\n"
        "port: 9001\n"
        "max-num-seqs: 16\n"
        "max_model_len: 1024\n"
        "enable-prefix-caching: false\n"
        "trust-remote-code: true\n"
        "served-model-name: [a, b]\n"
        "override-generation-config: {temperature: 0.3}\n"
        "allowed-origins: '[\"https://x.example\"]'\n"
    )
    args = parse(["serve", "--config", str(cfg), "--port", "9002"])  # the command line wins
    config = cli.engine_config(args)
    assert config == EngineConfig.from_kwargs(
        model="/from/file",
        max_num_seqs=16,
        max_model_len=1024,
        enable_prefix_caching=False,
        override_generation_config={"temperature": 0.3},
    )
    assert args.port == 9002 and args.served_model_name == ["a", "b"]
    assert args.trust_remote_code and vllm_args.cors_settings(args)["allow_origins"] == [
        "https://x.example"
    ]
    # A positional model on the command line beats the file's (vLLM's precedence), and a
    # list from the file does not swallow it.
    args = parse(["serve", "/cli", f"--config={cfg}"])
    assert args.model == "/cli" and args.served_model_name == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no-such-flag: 1\n", "unknown option 'no-such-flag'"),
        ("- a\n- b\n", "expected a mapping"),
        ("port: [\n", "not valid YAML"),
    ],
)
def test_bad_config_file(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as exc:
        parse(["serve", "--config", str(cfg)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_config_file_refused_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"fully-sharded-loras": True}))  # JSON is YAML too
    with pytest.raises(SystemExit) as exc:
        parse(["serve", "--config", str(cfg)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("pagemill: --fully-sharded-loras (a vLLM flag)")


def test_run_batch_refuses_vllm_run_batch_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--enable-metrics"], ["--output-tmp-dir", "/t"], ["--lora-modules", "a=b"]):
        with pytest.raises(SystemExit) as exc:
            parse(["run-batch", "-i", "a", "-o", "b", *argv])
        assert exc.value.code == 2
        assert capsys.readouterr().err.startswith(f"pagemill: {argv[0]}"), argv


def test_run_batch_takes_the_engine_flags() -> None:
    args = parse(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "/m", "-O0"])
    assert (args.input_file, args.output_file) == ("in.jsonl", "out.jsonl")
    assert cli.engine_config(args) == EngineConfig(model="/m", enforce_eager=True)


def test_hub_options_reach_huggingface_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pagemill.runtime.model_executor.model_source import hub_cache_dir

    # setenv first, so that monkeypatch restores these (apply_hub_options sets os.environ
    # itself, and a variable delenv found absent would not be removed afterwards).
    for name in ("HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    vllm_args.apply_hub_options(
        parse(["serve", "--download-dir", str(tmp_path), "--hf-token", "t"])
    )
    assert hub_cache_dir() == tmp_path and os.environ["HF_TOKEN"] == "t"
    monkeypatch.delenv("HF_TOKEN")
    vllm_args.apply_hub_options(parse(["serve", "--hf-token"]))  # the saved login: nothing to set
    assert "HF_TOKEN" not in os.environ


def test_override_generation_config(tmp_path: Path) -> None:
    from pagemill.runtime.generation_defaults import load_generation_defaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 100})
    )
    got = load_generation_defaults("auto", tmp_path, {"temperature": 0.2, "max_new_tokens": 5})
    assert got == {"temperature": 0.2, "top_p": 0.8, "max_tokens": 5}
    assert load_generation_defaults("vllm", tmp_path, {"top_k": 3}) == {"top_k": 3}
    with pytest.raises(ValueError, match="unknown key"):
        load_generation_defaults("auto", tmp_path, {"temprature": 0.2})
    with pytest.raises(ValueError, match="--override-generation-config"):
        load_generation_defaults("auto", tmp_path, {"temperature": -1})
