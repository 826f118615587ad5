"""The CLI's engine flags are derived from the config dataclasses: one flag per field, help from
the field's docstring, and parsing lands on the EngineConfig that from_kwargs builds."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pagemill.blockpool import CacheConfig
from pagemill.runtime.config import KWARG_ROUTES, EngineConfig
from pagemill.runtime.sample.structured_output import StructuredOutputsConfig
from pagemill.scheduler import SchedulerConfig
from pagemill.server import cli
from pagemill.server.config_args import field_docs
from pagemill.server.sim.cli import register

SECTIONS = {
    None: EngineConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "structured_outputs": StructuredOutputsConfig,
}
# argv prefix of each command that takes engine flags
COMMANDS = {"serve": ["serve"], "generate": ["generate", "a prompt"]}


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(argv)


def actions(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt: a for a in sub.choices[command]._actions for opt in a.option_strings}


def field_of(name: str) -> dataclasses.Field:
    section, field_name = KWARG_ROUTES[name]
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == field_name)


def test_field_docs_read_every_config_field() -> None:
    for cls, skip in (
        (EngineConfig, {"scheduler", "cache", "structured_outputs"}),
        (SchedulerConfig, set()),
        (CacheConfig, set()),
        (StructuredOutputsConfig, set()),
    ):
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)} - skip, cls
        assert all(len(text) > 20 and "\n" not in text for text in docs.values())
    assert field_docs(CacheConfig)["block_size"].startswith("Tokens per KV-cache block")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_config_field_has_a_flag_with_its_docstring(command: str) -> None:
    flags = actions(cli.build_parser(), command)
    for name, (section, field_name) in KWARG_ROUTES.items():
        action = flags["--" + name.replace("_", "-")]
        assert action.dest == name
        doc = field_docs(SECTIONS[section])[field_name]
        assert action.help is not None and action.help.startswith(doc.replace("%", "%%")), name
        if field_of(name).type == "bool":
            assert "--no-" + name.replace("_", "-") in flags


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flags_give_the_default_config(command: str) -> None:
    assert cli.engine_config(parse(COMMANDS[command])) == EngineConfig()


def _flag_value(name: str) -> tuple[list[str], Any]:
    """argv setting `name` to something other than its default, and that value in Python."""
    f = field_of(name)
    flag = "--" + name.replace("_", "-")
    if f.type == "bool":
        return ([f"--no-{flag[2:]}"] if f.default else [flag]), not f.default
    if "choices" in f.metadata:
        choice = next(c for c in f.metadata["choices"] if c not in (f.default, "auto"))
        return [flag, choice], choice
    if name.endswith("_bytes"):
        return [flag, "3MiB"], 3 * 2**20
    if name == "kv_events_config":  # vLLM's fields only
        return [flag, '{"topic": "kv"}'], {"topic": "kv"}
    if name == "speculative_config":  # vLLM's fields only
        spec = {"method": "ngram", "num_speculative_tokens": 3}
        return [flag, json.dumps(spec)], spec
    if f.type.startswith("dict"):
        return [flag, '{"temperature": 0.5}'], {"temperature": 0.5}
    if name == "max_logprobs":  # capped at its default
        return [flag, "5"], 5
    if f.type.startswith("int"):
        value = 300 if f.default in (None, dataclasses.MISSING) else f.default + 3
        return [flag, str(value)], value
    if f.type == "float":
        return [flag, "0.5"], 0.5
    value = {"device": "cpu", "pooler_config": '{"pooling_type": "MEAN"}'}.get(
        name, f"/some/{name}"
    )
    return [flag, value], value


_COMPANIONS = {
    "calculate_kv_scales": {"kv_cache_dtype": "fp8"},
    "kv_scales_per_head": {"kv_cache_dtype": "fp8"},
}


@pytest.mark.parametrize("name", sorted(KWARG_ROUTES))
@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_lands_on_its_field(command: str, name: str) -> None:
    argv, value = _flag_value(name)
    # Flags valid only beside another one: that one too, on both sides.
    companion = _COMPANIONS.get(name, {})
    for other, other_value in companion.items():
        argv += ["--" + other.replace("_", "-"), other_value]
    got = cli.engine_config(parse([*COMMANDS[command], *argv]))
    assert got == EngineConfig.from_kwargs(**{name: value}, **companion)
    assert got != EngineConfig()
    section, field_name = KWARG_ROUTES[name]
    owner = got if section is None else getattr(got, section)
    stored = getattr(owner, field_name)
    assert stored == (EngineConfig(dtype=value).dtype if name == "dtype" else value)


def test_old_and_vllm_spellings() -> None:
    def config(*argv: str) -> EngineConfig:
        return cli.engine_config(parse(["serve", *argv]))

    assert config("/m") == config("--model", "/m") == EngineConfig(model="/m")
    assert parse(["serve", "/m"]).model == "/m" and parse(["serve"]).model is None
    assert config("--kv-cache-memory", "1GiB") == config("--kv-cache-memory-bytes", "1073741824")
    assert config("--kv-cache-memory", "1GiB").cache.kv_cache_memory_bytes == 2**30
    no_cache = config("--no-prefix-caching")
    assert no_cache == config("--no-enable-prefix-caching")
    assert not no_cache.cache.enable_prefix_caching
    assert config("--scheduling-policy", "priority").scheduler.policy == "priority"
    for spelling, dtype in (
        ("half", "float16"),
        ("float", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
        ("float32", "float32"),
        ("auto", "auto"),
    ):
        assert config("--dtype", spelling).dtype == dtype
    gen = cli.engine_config(
        parse(
            [
                "generate",
                "hi",
                "--model",
                "/g",
                "--no-enable-chunked-prefill",
                "--max-num-batched-tokens",
                "4096",
            ]
        )
    )
    assert gen.model == "/g" and not gen.scheduler.enable_chunked_prefill


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "int4"],
        ["--prefix-caching-hash-algo", "md5"],
        ["--load-format", "pt"],
        ["--kv-cache-memory", "lots"],
        ["--max-num-seqs", "1.5"],
    ],
)
def test_bad_values_are_refused_by_the_parser(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["serve", *argv])
    assert exc.value.code == 2 and "error" in capsys.readouterr().err


def test_invalid_config_exits_2_before_loading_anything(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "_make_engine", lambda config: pytest.fail("engine built"))
    assert cli.main(["generate", "hi", "--block-size", "0"]) == 2
    assert "CacheConfig.block_size must be positive" in capsys.readouterr().err


def test_api_key_from_the_environment() -> None:
    assert cli.resolve_api_key(None, {"PAGEMILL_API_KEY": "env-key"}) == "env-key"
    assert cli.resolve_api_key("flag-key", {"PAGEMILL_API_KEY": "env-key"}) == "flag-key"
    assert cli.resolve_api_key(None, {"PAGEMILL_API_KEY": ""}) is None
    assert cli.resolve_api_key(None, {}) is None


def test_serve_passes_the_config_and_the_env_api_key(monkeypatch) -> None:
    import pagemill.server.async_engine as async_engine
    import pagemill.server.entrypoints.openai.api_server as api_server
    import pagemill.server.entrypoints.shutdown as shutdown
    import pagemill.server.metrics as metrics

    seen: dict[str, Any] = {}

    def make_engine(config: EngineConfig) -> Any:
        seen["config"] = config
        return SimpleNamespace(max_model_len=128)

    def build_app(client: Any, name: str, **kwargs: Any) -> str:
        seen.update(name=name, **kwargs)
        return "app"

    monkeypatch.setenv("PAGEMILL_API_KEY", "secret")
    monkeypatch.setattr(cli, "_make_engine", make_engine)
    monkeypatch.setattr(cli, "check_model", lambda config: seen.update(checked=config.model))
    monkeypatch.setattr(
        async_engine,
        "AsyncEngine",
        lambda engine, **kw: SimpleNamespace(
            max_model_len=engine.max_model_len, shutdown=lambda: None
        ),
    )
    monkeypatch.setattr(metrics, "EngineMetrics", lambda name: None)
    monkeypatch.setattr(api_server, "build_app", build_app)
    monkeypatch.setattr(
        shutdown, "serve", lambda app, client, **kw: seen.update(app=app, serve=kw) or 0
    )
    assert (
        cli.main(
            [
                "serve",
                "/models/x",
                "--block-size",
                "32",
                "--port",
                "9001",
                "--no-engine-process",
                "--shutdown-timeout",
                "7",
                "--step-timeout",
                "0",
                "--max-connections",
                "64",
                "--tool-call-parser",
                "llama3_json",
            ]
        )
        == 0
    )
    assert seen["config"] == EngineConfig(model="/models/x", cache=CacheConfig(block_size=32))
    assert seen["checked"] == "/models/x"
    assert seen["name"] == ["/models/x"] and seen["api_key"] == "secret" and seen["app"] == "app"
    assert seen["serve"]["shutdown_timeout"] == 7.0 and seen["serve"]["port"] == 9001
    assert seen["serve"]["limits"].max_connections == 64
    assert seen["watchdog"].step_timeout is None  # 0 disables the step watchdog
    assert seen["allow_special_tokens_in_chat"] is False
    assert seen["tool_call_parser"] == "llama3_json"
    # A fatal engine error makes `serve` return 1: so does the command.
    monkeypatch.setattr(shutdown, "serve", lambda app, client, **kw: 1)
    assert cli.main(["serve", "/models/x", "--no-engine-process"]) == 1


def test_generate_writes_the_deltas(monkeypatch, capsys) -> None:
    def out(text: str, ids: list[int], finish: str | None = None) -> Any:
        done = SimpleNamespace(text=text, token_ids=ids, finish_reason=finish)
        return SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[done])

    steps = [[out("Hel", [5])], [out("lo", [6, 7])], [out(" world", [8], "length")]]

    class Engine:
        tokenizer = None

        def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
            assert prompt == "hi"

        def has_unfinished_requests(self) -> bool:
            return bool(steps)

        def step(self) -> list[Any]:
            return steps.pop(0)

    monkeypatch.setattr(cli, "_make_engine", lambda config: Engine())
    monkeypatch.setattr(cli, "check_model", lambda config: None)
    assert cli.main(["generate", "hi", "-v"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello world\n"
    assert "[3 prompt tokens, 4 generated, finish_reason=length]" in captured.err


# ---------------------------------------------------------------- plan / simulate


def sim_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagemill")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_planner_flags_come_from_the_same_dataclasses(command: str) -> None:
    flags = actions(sim_parser(), command)
    args = sim_parser().parse_args([command])
    for cls, name in (
        (CacheConfig, "block_size"),
        (CacheConfig, "gpu_memory_utilization"),
        (SchedulerConfig, "max_num_seqs"),
        (SchedulerConfig, "max_num_batched_tokens"),
    ):
        action = flags["--" + name.replace("_", "-")]
        assert action.help.startswith(field_docs(cls)[name])
        assert getattr(args, name) == getattr(cls(), name)
    if command == "simulate":
        assert flags["--max-model-len"].help.startswith(
            field_docs(SchedulerConfig)["max_model_len"]
        )
        assert args.max_model_len == 4096


# ---------------------------------------------------------------- field_docs


def test_field_docs_reads_any_module_source(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "some_config.py").write_text(
        "from dataclasses import dataclass, field\n\n"
        "@dataclass(frozen=True)\n"
        "class Knobs:\n"
        '    """Class docstring."""\n\n'
        "    depth: int = 3\n"
        '    """How deep,\n    over two lines."""\n'
        "    width: int = 2\n"
        "    name: str = field(default='x')\n"
        "    '''Its name, 100% of it.'''\n"
    )
    spec = importlib.util.spec_from_file_location("some_config", tmp_path / "some_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "some_config", module)
    spec.loader.exec_module(module)
    assert dict(field_docs(module.Knobs)) == {
        "depth": "How deep, over two lines.",
        "name": "Its name, 100% of it.",
    }
    assert field_docs(dataclasses.make_dataclass("NoSource", [("a", int)])) == {}
