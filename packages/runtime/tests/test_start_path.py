"""What an engine core's start does without: xgrammar, transformers and the tokenizer.

The core process loads its grammars' tokenizer (and xgrammar) only once it is up or when a
grammar first needs it (`StructuredOutputManager.deferred`), and reads transformers' filled
config.json from the cache folder after the first start. Each check here would fail if a
start quietly went back to paying for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.sample.structured_output import StructuredOutputManager
from pagemill.runtime.sample.structured_output.params import StructuredOutputsParams


def test_importing_the_engine_core_imports_no_grammar_or_hub_library() -> None:
    code = (
        "import sys; import pagemill.runtime.engine.core; "
        "print(sorted(m for m in ('xgrammar', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: tuple[Path, Any]) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tiny_llama[0]))


def _admit(manager: StructuredOutputManager, rid: str, params: StructuredOutputsParams) -> None:
    manager.add_request(rid, params)
    deadline = time.monotonic() + 120
    while not manager.is_ready(rid):
        assert time.monotonic() < deadline, "the grammar did not compile"
        manager.wait_any([rid], 0.5)
    assert manager.error(rid) is None
    manager.start(rid)


def test_a_deferred_manager_loads_the_tokenizer_at_its_first_grammar(tokenizer: Any) -> None:
    vocab = len(tokenizer)
    eos = [tokenizer.eos_token_id]
    calls: list[int] = []

    def load() -> tuple[Any, list[int]]:
        calls.append(1)
        return tokenizer, eos

    deferred = StructuredOutputManager.deferred(load, vocab, max_num_seqs=2)
    assert calls == []  # built without the tokenizer
    assert deferred.grammar_bitmask(["a"]) is None
    eager = StructuredOutputManager(tokenizer, vocab, eos, 2, prestart=False)
    params = StructuredOutputsParams(choice=["hello world", "low"])
    try:
        _admit(deferred, "r", params)
        _admit(eager, "r", params)
        assert calls == [1]
        got, want = deferred.grammar_bitmask(["r"]), eager.grammar_bitmask(["r"])
        assert got is not None and want is not None and torch.equal(got, want)
        assert not torch.all(got == -1)  # the grammar does restrict the first token
        _admit(deferred, "s", params)
        assert calls == [1]  # loaded once
    finally:
        deferred.shutdown()
        eager.shutdown()


def test_a_deferred_manager_without_a_tokenizer_refuses_each_grammar() -> None:
    calls: list[int] = []

    def load() -> tuple[Any, list[int]]:
        calls.append(1)
        return None, []

    manager = StructuredOutputManager.deferred(load, 100, max_num_seqs=2)
    for rid in ("a", "b"):
        with pytest.raises(ValueError, match="needs a tokenizer"):
            manager.add_request(rid, StructuredOutputsParams(regex="[ab]+"))
    assert calls == [1] and manager.num_requests == 0


def test_the_filled_config_is_kept_and_read_back_unchanged(
    tiny_llama: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = tiny_llama
    monkeypatch.setenv("PAGEMILL_HF_CONFIG_CACHE", "0")
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path))
    from_transformers = ModelConfig.from_pretrained(folder)
    assert not (tmp_path / "hf-configs").exists()
    monkeypatch.delenv("PAGEMILL_HF_CONFIG_CACHE")
    assert ModelConfig.from_pretrained(folder) == from_transformers  # written now
    [kept] = (tmp_path / "hf-configs").iterdir()
    assert ModelConfig.from_pretrained(folder) == from_transformers  # read back
    # The entry is what is served: a different one is used as it is...
    raw = json.loads(kept.read_text())
    raw["rms_norm_eps"] = 0.25
    kept.write_text(json.dumps(raw))
    assert ModelConfig.from_pretrained(folder).rms_norm_eps == 0.25
    # ...a broken one is replaced...
    kept.write_text("{")
    assert ModelConfig.from_pretrained(folder) == from_transformers
    assert json.loads(kept.read_text())["rms_norm_eps"] == from_transformers.rms_norm_eps
    # ...and a changed config.json is another entry.
    other = tmp_path / "other"
    other.mkdir()
    changed = json.loads((folder / "config.json").read_text())
    changed["rms_norm_eps"] = 0.125
    (other / "config.json").write_text(json.dumps(changed))
    assert ModelConfig.from_pretrained(other).rms_norm_eps == 0.125
    assert len(list((tmp_path / "hf-configs").iterdir())) == 2


def test_a_core_start_reads_the_grammar_table_back_instead_of_the_tokenizer(
    tiny_llama: tuple[Path, Any],
    tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first start builds xgrammar's table from the tokenizer and keeps it; the next
    (same files) reads it back without loading the tokenizer and constrains the same
    tokens; an edited tokenizer file, a torn entry or PAGEMILL_TOKENIZER_CACHE=0 build it
    again from the tokenizer."""
    import shutil

    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine import model_assets
    from pagemill.runtime.engine.model_assets import ModelAssets

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama[0], folder)
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEMILL_TOKENIZER_CACHE", raising=False)
    loads: list[str] = []
    real_load = model_assets.load_tokenizer

    def counting_load(path: str) -> Any:
        loads.append(path)
        return real_load(path)

    monkeypatch.setattr(model_assets, "load_tokenizer", counting_load)
    config = EngineConfig(model=str(folder))
    params = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    vocab = len(tokenizer)
    eager = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id], 2, prestart=False)

    def start_and_mask() -> torch.Tensor:
        manager = ModelAssets.load(config, tokenizer=False).structured_output_manager(
            config, deferred=True
        )
        assert manager is not None
        try:
            _admit(manager, "r", params)
            mask = manager.grammar_bitmask(["r"])
            assert mask is not None
            return mask.clone()
        finally:
            manager.shutdown()

    try:
        _admit(eager, "r", params)
        want = eager.grammar_bitmask(["r"])
        assert want is not None and not torch.all(want == -1)
        assert torch.equal(start_and_mask(), want) and len(loads) == 1  # built, saved
        [entry] = (tmp_path / "cache" / "tokenizer-info").iterdir()
        assert torch.equal(start_and_mask(), want) and len(loads) == 1  # read back
        entry.write_text(entry.read_text()[:100])  # torn: built again, rewritten
        assert torch.equal(start_and_mask(), want) and len(loads) == 2
        assert torch.equal(start_and_mask(), want) and len(loads) == 2
        monkeypatch.setenv("PAGEMILL_TOKENIZER_CACHE", "0")
        assert torch.equal(start_and_mask(), want) and len(loads) == 3
        monkeypatch.delenv("PAGEMILL_TOKENIZER_CACHE")
        special = json.loads((folder / "tokenizer_config.json").read_text())
        special["model_max_length"] = 77  # any edit of a tokenizer file: a new key
        (folder / "tokenizer_config.json").write_text(json.dumps(special))
        assert torch.equal(start_and_mask(), want) and len(loads) == 4
        assert len(list((tmp_path / "cache" / "tokenizer-info").iterdir())) == 2
        monkeypatch.setenv("PAGEMILL_TOKENIZER_CACHE", "yes")
        with pytest.raises(ValueError, match="PAGEMILL_TOKENIZER_CACHE"):
            start_and_mask()
    finally:
        eager.shutdown()


def test_an_unreadable_tokenizer_file_means_no_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagemill.runtime.sample.structured_output.tokenizer_cache import info_key

    (tmp_path / "tokenizer.json").write_text("{}")
    key = info_key(str(tmp_path), 100, [2])
    assert key is not None and key == info_key(str(tmp_path), 100, [2])
    assert key != info_key(str(tmp_path), 101, [2]) != info_key(str(tmp_path), 100, [3])
    (tmp_path / "vocab.json").mkdir()  # is_file() False: counted as absent
    assert info_key(str(tmp_path), 100, [2]) == key
    (tmp_path / "merges.txt").write_text("#")
    assert info_key(str(tmp_path), 100, [2]) not in (None, key)
    real_read = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self.name == "merges.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert info_key(str(tmp_path), 100, [2]) is None
    assert info_key(str(tmp_path / "absent"), 100, [2]) is None
