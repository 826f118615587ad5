"""`gguf_once.parsed_once`: one parse of a GGUF's header while a model folder is made from it
(transformers' config and tokenizer loaders and the engine's tensor table all read it)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import gguf
import numpy as np

from pagemill.runtime.model_executor import default_model as dm
from pagemill.runtime.model_executor.gguf_once import parsed_once
from pagemill.runtime.model_executor.gguf_weights import GGUFCheckpoint
from pagemill.runtime.model_executor.loader import GGUF_INDEX_FILE


def _tiny_gguf(path: Path, value: int) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("token_embd.weight", np.full((2, 4), value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_reader_per_file_inside_and_the_class_restored_after(tmp_path: Path) -> None:
    original = gguf.GGUFReader
    a, b = _tiny_gguf(tmp_path / "a.gguf", 1), _tiny_gguf(tmp_path / "b.gguf", 2)
    with parsed_once(a):
        first = gguf.GGUFReader(str(a))
        assert gguf.GGUFReader(a) is first  # any spelling of the same file
        assert gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is first
        other = gguf.GGUFReader(str(b))  # another file: parsed as usual, each time
        assert other is not gguf.GGUFReader(str(b))
        assert int(other.fields["test.value"].contents()) == 2
        assert gguf.GGUFReader(str(a), "r") is not first  # other arguments: not shared
        with parsed_once(b):  # nested: both shared, the class kept until the outer ends
            assert gguf.GGUFReader(str(b)) is gguf.GGUFReader(str(b))
        assert gguf.GGUFReader(str(b)) is not gguf.GGUFReader(str(b))
        assert int(first.fields["test.value"].contents()) == 1
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(str(a)) is not gguf.GGUFReader(str(a))


def test_concurrent_contexts_restore_the_class(tmp_path: Path) -> None:
    original = gguf.GGUFReader
    files = [_tiny_gguf(tmp_path / f"{i}.gguf", i) for i in range(4)]
    barrier = threading.Barrier(len(files))
    seen: list[bool] = []

    def work(path: Path) -> None:
        with parsed_once(path):
            barrier.wait()
            seen.append(gguf.GGUFReader(str(path)) is gguf.GGUFReader(str(path)))
            barrier.wait()

    threads = [threading.Thread(target=work, args=(p,)) for p in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] * len(files) and gguf.GGUFReader is original


def test_the_default_models_folder_comes_from_one_parse(tmp_path: Path, monkeypatch) -> None:
    """Extracting the default model's folder parses its GGUF once (it was three times: the
    config, the tokenizer, the engine's tensor table) and leaves the tensor table the
    engine reads, equal to one made from a parse of its own."""
    parses: list[str] = []
    original = gguf.GGUFReader

    class Counting(original):  # type: ignore[misc,valid-type]
        def __init__(self, path, *args, **kwargs):
            parses.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    source = dm.find_gguf()
    target = tmp_path / "SmolLM2"
    dm._convert(source, dm.GGUF_SHA256, target)
    assert parses == [str(source)]
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    index = json.loads((target / GGUF_INDEX_FILE).read_text())
    fresh = GGUFCheckpoint(source)  # no index: parses the file
    assert len(parses) == 2
    assert index["architecture"] == fresh.architecture == "llama"
    assert index["block_count"] == fresh.block_count
    assert [tuple(t) for t in index["tensors"]] == fresh.tensors
    reopened = GGUFCheckpoint(source, index_file=target / GGUF_INDEX_FILE)
    assert reopened.tensors == fresh.tensors and len(parses) == 2  # read back, not parsed
