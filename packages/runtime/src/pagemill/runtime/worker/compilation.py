"""The model's forward as a compiled graph on CPU (torch.compile, inductor).

An eager decode step is ~1,800 small ops, each paying Python and dispatcher overhead, and
at batch 1 that overhead is most of the step. Compiled, the norms, rotary, activations and
residual adds fuse into a few C++ loops, and with `freezing` the linear weights are
prepacked for oneDNN once. The KV write and paged attention are custom ops
(`pagemill.kernels.ops`), so the graph never breaks at them; the attention plan crosses
it as an opaque object. Where the C++ operators serve (CPU: every KV write in the compute
dtype, and attention in decode-only steps) the graph calls them directly instead, with
plain tensors: no Python between the graph's kernels. A decode-only step of several
requests is then a graph of its own (`ModelRunner.decode_graph_token_counts`).

Shapes: the token dimension is dynamic, so one graph serves every batch size and prefill
chunk (torch specializes size 1, the decode of a single request, into a second graph);
there is nothing to recompile per batch size, which is what bucketing would otherwise
bound. Guards: dynamo would check every parameter and module attribute on every call
(~3,700 guards, ~3 ms a step); the model does not change between steps, so only the
inputs' guards are kept. Every graph is compiled at start-up.

Per-call host cost (largest at batch 1, where the weights' streaming is most of the step
and Python the rest): the floats (the norms' epsilons) are traced as constants
(`model_trace_config`), not as inputs the frame's prologue wraps in a tensor each call, and
the one-token graph and the decode-only graphs of several requests get inductor's C++
wrapper (`CPP_WRAPPER_ENV`), which calls their ~300 kernels and ops from C++; the graphs
that take the attention plan (prefill-like steps) keep the Python wrapper, whose per-call
cost is a small share of their larger steps. And the graph takes few inputs: each costs
every call (dynamo's bytecode fetches it by its attribute path, the wrapper passes it on,
the C++ wrapper turns it into a pointer), so the tensors every layer has one of are read as
slices of the one tensor each kind lives in — the packed weights' mapping
(`huge_page_weights.arena_view`), the norms' gathered weights (`gathered_params`), the KV
pool (`LlamaAttention._graph_kv`) — rather than one input per layer and kind.

Inductor's on-disk cache (under pagemill's cache folder unless TORCHINDUCTOR_CACHE_DIR says
otherwise) keeps the generated code, so a later start skips code generation and C++ builds.

Regional compilation (opt-in: `PAGEMILL_COMPILE_REGIONAL=1`, with the compile cache):
tracing, AOT autograd and inductor's lowering cost grows with the graph, and a decoder's
layers are alike, so each group of identical layers (`layer_groups`: same classes, formats,
flags and tensor shapes) is compiled once as its own function, and every layer of the group
runs it with its own weights (graph inputs); the forward around them (embedding, the layer
loop, the final norm) stays eager. The layers' own guards are dropped as the whole model's
are: safe because a group's layers differ only in tensor values. The frozen compile
(`PAGEMILL_COMPILE_CACHE=0`) is always whole-model: frozen weights would be constants of the
first layer. `benchmarks/step_ab.py --variant regional` is the step's A/B against the
whole-model graph, `benchmarks/compile_time.py` times the compile. Off by default: the
interleaved A/B measured the regional step slower at every batch size (the eager loop, a
compiled call per layer, nothing fused across layers); switch the default if a quiet-machine
rerun says otherwise.

The compile cache (`CompileCache`): dynamo's trace is kept too, with torch's caching
precompile (a dynamo package per compiled function, a layer group's each, with its graphs and
the AOT-autograd/inductor artefacts they call), in a folder of its own per key under
`<pagemill cache>/compiled/`.
The key is everything that changes the graph: the model's structure (every module's type
and plain attributes, every tensor's name, shape, dtype and layout: weights formats
included), its config, dtype, the engine limits and KV pool shape, torch and Python
versions, the CPU's features and pagemill's own source. Weights' values are not in the
key: without `freezing` they are inputs of the graph, not constants (freezing's prepacked
oneDNN weights bypass AOT autograd's cache, so a cached start compiles without it). A
warm start loads the package instead of tracing; an entry that fails to load is logged,
removed and rebuilt.

Status: on by default; `PAGEMILL_COMPILE_CACHE=0` compiles at every start, with `freezing`.
`benchmarks/compile_cache.py` is the fair test of that choice: both graphs in one process,
their steps interleaved, so a loaded machine slows both alike (runs one after the other on
a shared box measure the load, not the graphs). It was made the default once the unfrozen
step measured within a few percent of the frozen one's there; rerun it when the graph or
torch changes, and if the cached graph falls well behind, keep the speed first (weights
prepacked outside the graph, inductor's mega-cache or AOTInductor).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pagemill.runtime.switches import env_switch

logger = logging.getLogger(__name__)

# Set (to 1) to make `enforce_eager` the default, e.g. for a test suite that builds many
# engines and only wants to pay for compilation in the tests about it.
ENFORCE_EAGER_ENV = "PAGEMILL_ENFORCE_EAGER"
# Set to 0 to compile at every start (and with inductor's `freezing`), as before the cache;
# 1 (or unset) uses the compile cache.
COMPILE_CACHE_ENV = "PAGEMILL_COMPILE_CACHE"
# Set to 1 to compile the compile cache's forward as one graph per group of identical decoder
# layers (regional compilation) instead of one graph of the whole model: a first start
# compiles several times faster, but the step measured slower (see the module docstring).
REGIONAL_ENV = "PAGEMILL_COMPILE_REGIONAL"
# Bump when what a cache entry holds, or how it is keyed, changes.
_CACHE_FORMAT = 3

_INPUTS = ("input_ids", "positions", "meta")


def _cxx_compiler() -> str | None:
    name = os.environ.get("CXX") or "g++"
    return shutil.which(name) or shutil.which("c++") or shutil.which("clang++")


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why the forward cannot be compiled here, or None when it can."""
    if device.type != "cpu":
        return "the compiled step is CPU-only for now"
    from pagemill.kernels.ops import COMPILE_READY

    if not COMPILE_READY:
        return (
            f"torch {torch.__version__} cannot pass the attention plan through a "
            "compiled graph (needs torch's opaque custom classes)"
        )
    if _cxx_compiler() is None:
        return (
            "no C++ compiler found (inductor needs g++ or clang++; install one, "
            "e.g. `apt-get install g++`, or set CXX)"
        )
    return None


def _guard_filter(inputs: tuple[str, ...]) -> Callable[[list[Any]], list[bool]]:
    """Keep the guards on the compiled function's `inputs` (shapes, dtypes) and on symbolic
    sizes (a layer may branch on the token count, e.g. packed vs dense weights); drop the
    model's own (parameters, modules, globals), which do not change between steps."""

    def keep(guards: list[Any]) -> list[bool]:
        return [
            g.guard_type == "SHAPE_ENV" or g.name.split(".")[0].split("[")[0] in inputs
            for g in guards
        ]

    return keep


_keep_input_guards = _guard_filter(_INPUTS)


def _private_function(fn: Callable[..., Any], qualname: str) -> types.FunctionType:
    """`fn` over a private copy of its code object, named `qualname`.

    Dynamo keeps compiled graphs on the code object, shared by every instance of the class,
    and the model's own guards are dropped (`_guard_filter`): a second model in this
    process (another engine, another weight format) would run the first one's graph —
    its weight formats, its branches. A code object of its own gives each its own cache;
    its own name gives it its own package in the compile cache, which finds a package by
    the function's qualified name and first line.
    """
    assert isinstance(fn, types.FunctionType), fn
    private = types.FunctionType(
        fn.__code__.replace(),
        fn.__globals__,
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )
    private.__kwdefaults__ = fn.__kwdefaults__
    private.__qualname__ = qualname
    return private


def _private_forward(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`model.forward` bound over a private copy of its code (see `_private_function`)."""
    forward = type(model).forward
    return types.MethodType(_private_function(forward, forward.__qualname__), model)


# Inductor options of every compiled forward.
# `size_asserts` off: the generated Python wrapper would otherwise check every graph
# input's sizes and strides and every custom op's output metadata on every call (hundreds
# of checks a step for a 30-layer model, a noticeable share of a small step); the model's
# tensors do not change between steps and their metadata is in the compile cache's key.
# `cpp.min_chunk_size`: inductor makes a generated loop an OpenMP region only when each
# thread gets at least this many elements at the size the graph was traced at, and a
# token-dynamic graph is traced at 2 tokens (`ModelRunner.graph_token_counts`). At decode
# sizes an OpenMP fork and barrier cost more than a norm's or the rotary's arithmetic
# (and far more when a thread is descheduled on a busy machine), so with 1024 a small
# model's per-row loops over its hidden size stay serial (RMSNorm with its residual add,
# RoPE; hidden sizes under 1024) while the SiLU-and-mul over the wider MLP rows stays
# parallel, where it pays off at large batches. A graph traced at more tokens (a
# packed/dense crossover's) is judged at that size.
INDUCTOR_OPTIONS: dict[str, Any] = {"size_asserts": False, "cpp.min_chunk_size": 1024}
# Which graphs get a C++ wrapper (inductor's `cpp_wrapper`) instead of the Python one that
# calls their kernels: `1` every graph that can have one (the default: those without the
# attention plan, an opaque Python object a C++ wrapper cannot pass, i.e. the one-token
# graph and the decode-only graphs of several requests on the C++ decode operator),
# `single` only the graph of a one-token step (no symbolic size: the batch-1 decode), `0`
# none. The Python wrapper pays interpreter time per kernel and op it calls (~300 in a
# decode step of this model), whatever the batch size; the C++ one calls them from C++.
# A C++ wrapper costs cold compile time (the background compile of a cold start, not the
# time to healthy nor a warm start), which `CPP_WRAPPER_BUILD_SEPARATE` keeps down.
CPP_WRAPPER_ENV = "PAGEMILL_CPP_WRAPPER"
_CPP_WRAPPER_MODES = ("0", "1", "single")
# Inductor's `cpp_wrapper_build_separate`: the wrapper (thousands of lines of straight-line
# calls) compiles at -O1 and apart from the fused loops, which keep -O3. Built as one -O3
# unit, the wrappers were most of a cold compile's C++ time; the wrapper's own code is not
# where a step spends its time (the loops and the ops it calls are). Off only to measure it
# (`benchmarks/step_ab.py --variant cpp-wrapper-before`).
CPP_WRAPPER_BUILD_SEPARATE = True


def cpp_wrapper_mode() -> str:
    """`0`, `1` or `single` (see `CPP_WRAPPER_ENV`; unset: `1`); any other value is
    refused."""
    value = os.environ.get(CPP_WRAPPER_ENV, "1").strip() or "1"
    if value not in _CPP_WRAPPER_MODES:
        raise ValueError(f"{CPP_WRAPPER_ENV} must be one of {_CPP_WRAPPER_MODES}, got {value!r}")
    return value


def cpp_wrapper_enabled() -> bool:
    return cpp_wrapper_mode() != "0"


@contextlib.contextmanager
def model_trace_config() -> Iterator[None]:
    """Dynamo settings for tracing the model's forward (wrap its first calls: the warm-up).

    `specialize_float`: a module's float attributes (every norm's epsilon) become constants
    of the graph. Unspecialized, each is a graph input that the frame's prologue wraps in a
    new tensor on every call (`torch._as_tensor_fullprec`), one per norm per step. Their
    values are in the compile cache's key (plain module attributes), and their guards are
    dropped with the model's (`_guard_filter`), as for every other attribute. Scoped to the
    model's trace: other compiled functions (the sampler's) take floats that do change.
    A graph traced outside this (a recompile mid-serving) is only slower, never wrong."""
    with torch._dynamo.config.patch(specialize_float=SPECIALIZE_FLOATS):
        yield


# Off only to measure what `model_trace_config` saves (`benchmarks/step_ab.py`).
SPECIALIZE_FLOATS = True


def _has_opaque_input(example_inputs: list[Any]) -> bool:
    from torch._library.fake_class_registry import FakeScriptObject

    opaque = (torch.ScriptObject, FakeScriptObject)
    return any(
        isinstance(x, opaque) or type(x).__module__.startswith("pagemill.") for x in example_inputs
    )


def _has_symbolic_input(example_inputs: list[Any]) -> bool:
    """Whether a graph's inputs have a symbolic size (a token-dynamic graph)."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(
            isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())
        ):
            return True
    return False


def _inductor_per_graph(options: dict[str, Any], single_only: bool = False) -> Callable[..., Any]:
    """A backend that compiles each graph with inductor and `options`, plus `cpp_wrapper`
    where the graph takes no opaque object (and, `single_only`, has no symbolic size)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        wrap = not _has_opaque_input(example_inputs)
        if single_only and _has_symbolic_input(example_inputs):
            wrap = False
        patches = {**options, "cpp_wrapper": wrap}
        if wrap:
            patches["cpp_wrapper_build_separate"] = CPP_WRAPPER_BUILD_SEPARATE
            shims = _native_c_shims()
            if shims:
                patches["aot_inductor.custom_ops_to_c_shims"] = shims
        logger.info("compile: a graph with cpp_wrapper=%s", patches["cpp_wrapper"])
        return compile_fx(gm, example_inputs, config_patches=patches)

    return backend


def _native_c_shims() -> dict[Any, list[str]]:
    """The C entry points a C++ wrapper calls the native CPU operators through
    (`cpu_native.c_shims`; empty where they are not available)."""
    from pagemill.kernels import cpu_native

    return cpu_native.c_shims()


def _set_inductor_cache_dir() -> None:
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from pagemill.runtime.model_executor.default_model import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


def _mark_static_attributes(model: torch.nn.Module) -> None:
    """Tell dynamo the model's own tensor attributes (KV caches, packed weights) keep their
    shapes: with `dynamic=True` it would otherwise give every size and stride of the KV
    caches a symbol, and the shape guard relating them (kept: it is SHAPE_ENV) grows with
    the layer count, and rebuilding it was a large part of loading a cached graph. Their
    shapes are in the compile cache's key, and they do not change between steps. (Not the
    buffers a layer receives as arguments, the rotary table: a compiled graph loaded from
    the compile cache guards that its inputs carry no such marking, and would never match.)"""
    for module in model.modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            values = value if isinstance(value, (list, tuple)) else (value,)
            for v in values:
                if isinstance(v, torch.Tensor):
                    torch._dynamo.mark_static(v)


def layer_groups(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The model's decoder layers (`model.layers`), grouped by structure: layers whose
    `model_signature` is the same (same classes, formats, flags, tensor shapes, sliding
    window...) trace to the same graph, so one compiled function serves a group. The first
    layer is a group of its own: it alone gets no residual stream, a graph each way, and
    dynamo keeps a bounded number of graphs per function (`recompile_limit`). Empty when
    the model has no `layers` list."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return []
    groups: dict[str, list[torch.nn.Module]] = {}
    for i, layer in enumerate(layers):
        key = json.dumps([i == 0, model_signature(layer)])
        groups.setdefault(key, []).append(layer)
    return list(groups.values())


def _compile_layers(groups: list[list[torch.nn.Module]]) -> None:
    """Regional compilation: one compiled function per group of identical decoder layers,
    set as each layer's `forward`. Tracing and lowering cost grows with the graph, so a
    graph of one layer compiles about a layer-count times faster than the whole model's;
    the model's own forward (embedding, the layer loop, the final norm) stays eager.

    The layer's guards on itself are dropped like the whole model's (`_guard_filter`), so
    every layer of a group runs the graph traced on the first: safe because the group's
    layers agree on everything the trace reads but the tensors' values, which are inputs
    of the graph (without `freezing`: frozen weights would be the first layer's constants,
    so the frozen compile stays whole-model)."""
    for i, group in enumerate(groups):
        cls = type(group[0])
        forward = _private_function(cls.forward, f"{cls.__qualname__}.forward_group{i}")
        code = forward.__code__
        inputs = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
        compiled = torch.compile(
            forward,
            dynamic=True,
            fullgraph=True,
            options={
                **INDUCTOR_OPTIONS,
                "freezing": False,
                "guard_filter_fn": _guard_filter(inputs),
            },
        )
        for layer in group:
            # An instance attribute: `nn.Module.__call__` runs it (hooks included).
            layer.forward = functools.partial(compiled, layer)


def uncompile_layers(model: torch.nn.Module) -> None:
    """Undo `_compile_layers`: every layer back on its class's eager forward."""
    layers = getattr(model, "layers", None)
    for layer in layers if isinstance(layers, torch.nn.ModuleList) else ():
        if isinstance(vars(layer).get("forward"), functools.partial):
            del layer.forward


def compile_forward(
    model: torch.nn.Module, freezing: bool = True, regional: bool | None = None
) -> Callable[..., Any]:
    """The compiled `model.forward` (compiles lazily, on the first call of each graph).

    `regional` (default: with `PAGEMILL_COMPILE_REGIONAL=1`, unless `freezing`; it needs
    decoder `layers`)
    compiles each group of identical layers once (`_compile_layers`) and returns the
    eager `model.forward` that calls them; otherwise the whole forward is one graph."""
    from pagemill.kernels import ops  # noqa: F401 - registers the custom ops

    _set_inductor_cache_dir()
    uncompile_layers(model)
    _mark_static_attributes(model)
    if regional is None:
        regional = not freezing and regional_enabled()
    if regional and freezing:
        raise ValueError("regional compilation cannot freeze weights (see _compile_layers)")
    groups = layer_groups(model) if regional else []
    if groups:
        _compile_layers(groups)
        return model.forward
    if cpp_wrapper_enabled():
        return torch.compile(
            _private_forward(model),
            backend=_inductor_per_graph(
                {**INDUCTOR_OPTIONS, "freezing": freezing},
                single_only=cpp_wrapper_mode() == "single",
            ),
            dynamic=True,
            fullgraph=True,
            options={"guard_filter_fn": _keep_input_guards},
        )
    return torch.compile(
        _private_forward(model),
        dynamic=True,
        fullgraph=True,
        options={
            **INDUCTOR_OPTIONS,
            "freezing": freezing,
            "guard_filter_fn": _keep_input_guards,
        },
    )


# ---- the compile cache ---------------------------------------------------------------------


def regional_enabled() -> bool:
    """Off unless `PAGEMILL_COMPILE_REGIONAL=1` (any value but 0 or 1 is refused)."""
    return env_switch(REGIONAL_ENV, default=False)


def compile_cache_enabled() -> bool:
    """On unless `PAGEMILL_COMPILE_CACHE=0`; any other value than 0 or 1 is refused, so a
    misspelt attempt to turn it off is not silently ignored."""
    return env_switch(COMPILE_CACHE_ENV, default=True)


_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _tensor_sig(t: torch.Tensor) -> list[Any]:
    return [
        list(t.shape),
        list(t.stride()),
        str(t.dtype),
        t.device.type,
        t.layout.__repr__(),
        type(t).__name__,
    ]


# How deep `model_signature` follows pagemill's own objects hung on a module (a Linear's
# LoRA slots, then their shared step mapping).
_OBJECT_DEPTH = 3


def _value_sig(value: Any, depth: int) -> Any:
    """A module attribute's part of the signature: tensors' metadata, plain values, and the
    attributes of pagemill's own objects (LoRA slots, weight schemes, KV scales): their
    tensors are read by the graph too, and dynamo's guards on them are dropped."""
    if isinstance(value, torch.Tensor):
        return _tensor_sig(value)
    if _plain(value):
        return repr(value)
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return [_tensor_sig(v) for v in value]
    cls = type(value)
    name = cls.__module__ + "." + cls.__qualname__
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return ["function", f"{value.__module__}.{value.__qualname__}"]
    if depth > 0 and cls.__module__.startswith("pagemill.") and hasattr(value, "__dict__"):
        return [name, [[k, _value_sig(v, depth - 1)] for k, v in sorted(vars(value).items())]]
    return cls.__qualname__


def model_signature(model: torch.nn.Module) -> list[Any]:
    """What of `model` a compiled graph depends on: per module its type, plain attributes
    (formats, flags, sizes) and tensors' metadata (parameters, buffers and plain tensor
    attributes such as KV caches and packed weights, and those of pagemill objects it
    holds, such as LoRA slots); never the tensors' values."""
    sig: list[Any] = []
    for name, module in model.named_modules():
        attrs: list[Any] = []
        for key, value in sorted(vars(module).items()):
            if key in ("_parameters", "_buffers"):
                for pname, p in sorted(value.items()):
                    attrs.append([key, pname, None if p is None else _tensor_sig(p)])
            elif key in ("_modules", "forward") or key.startswith("__"):
                continue
            else:
                attrs.append([key, _value_sig(value, _OBJECT_DEPTH)])
        sig.append([name, type(module).__module__ + "." + type(module).__qualname__, attrs])
    return sig


def class_switches(model: torch.nn.Module) -> list[Any]:
    """The plain class attributes of pagemill's module classes in `model` (and their
    pagemill bases): class-wide switches such as `Linear.compiled_branch`,
    `Linear.opaque_packed` or `FusedMoE.pack_gguf_experts`, which no instance holds."""
    seen: dict[str, list[Any]] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            name = cls.__module__ + "." + cls.__qualname__
            if not cls.__module__.startswith("pagemill.") or name in seen:
                continue
            seen[name] = [
                [k, repr(v)]
                for k, v in sorted(vars(cls).items())
                if not k.startswith("__") and _plain(v)
            ]
    return sorted(seen.items())


# The runtime's sources the forward's graph is traced from (the kernels package: all of it).
_GRAPH_SOURCES = (
    "model_executor/models",
    "model_executor/layers",
    "model_executor/quantization",
    "distributed",
    "lora/layers.py",
    "worker/attention_metadata.py",
    "worker/compilation.py",
    "worker/kv_cache.py",
    "model_config.py",
    "moe_config.py",
)


def _source_digest() -> str:
    """The source the graph is traced from: editing it may change the graph."""
    import pagemill.kernels
    import pagemill.runtime

    paths: list[tuple[str, Path]] = []
    for root in map(Path, pagemill.kernels.__path__):
        paths += [(f"kernels/{p.relative_to(root)}", p) for p in root.rglob("*.py")]
    for root in map(Path, pagemill.runtime.__path__):
        for name in _GRAPH_SOURCES:
            top = root / name
            if not top.exists():  # a source moved: the key must not silently lose it
                raise FileNotFoundError(f"compile cache: graph source {top} is missing")
            found = [top] if top.is_file() else sorted(top.rglob("*.py"))
            paths += [(f"runtime/{p.relative_to(root)}", p) for p in found]
    h = hashlib.sha256()
    for rel, path in sorted(paths):
        h.update(rel.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _cpu_flags() -> str:
    from pagemill.runtime.worker.cpu_features import _cpuinfo_flags

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    return " ".join(sorted(_cpuinfo_flags(text)))


def compile_cache_key(
    model: torch.nn.Module, settings: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The key of a compiled forward (hex digest) and what it was computed from."""
    parts = {
        "format": _CACHE_FORMAT,
        "regional": regional_enabled(),
        "cpp_wrapper": cpp_wrapper_mode(),
        "cpp_wrapper_build_separate": CPP_WRAPPER_BUILD_SEPARATE,
        # A graph compiled with the shims calls their symbols: not one to load without them.
        "native_c_shims": bool(_native_c_shims()),
        "specialize_floats": SPECIALIZE_FLOATS,
        # Class-wide switches (not in any module's own attributes) that change the graph.
        "classes": class_switches(model),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu": hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "pagemill_source": _source_digest()[:16],
        "settings": {k: repr(v) for k, v in sorted(settings.items())},
        "model": hashlib.sha256(json.dumps(model_signature(model)).encode()).hexdigest()[:16],
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return key, parts


class CompileCache:
    """One key's folder of compiled artefacts; `session()` wraps a compilation.

    Inside `session()`, `torch.compile` creates a dynamo package for the forward; the first
    call of each graph either loads it from this folder (no trace) or traces and compiles,
    and `save()` writes what was compiled. `loaded` says whether the package came from here.
    """

    def __init__(self, root: Path, key: str, parts: dict[str, Any]) -> None:
        self.folder = root / key[:32]
        self.key = key
        self.parts = parts
        self.loaded = False
        self._before: dict[str, int] = {}
        self._traced_before = 0

    @staticmethod
    def root() -> Path:
        from pagemill.runtime.model_executor.default_model import cache_dir

        return cache_dir() / "compiled"

    def _counters(self) -> dict[str, int]:
        from torch._dynamo.utils import counters

        return counters["dynamo_cache"]

    @staticmethod
    def _traced() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @contextlib.contextmanager
    def session(self) -> Iterator[CompileCache]:
        from torch._dynamo import package
        from torch._dynamo.precompile_context import PrecompileContext

        _set_inductor_cache_dir()
        store = package.DynamoCache
        dynamo_dir = str(self.folder / "dynamo")
        # The store's folder is this key's: a package is found by its function's name and
        # line only, which every model shares.
        store.path_prefix = lambda: dynamo_dir  # type: ignore[method-assign]
        PrecompileContext.clear()
        self._before = dict(self._counters())
        self._traced_before = self._traced()
        try:
            with torch._dynamo.config.patch(caching_precompile=True):
                yield self
        finally:
            del store.path_prefix  # back to the class's own
            self.loaded = self.fully_loaded()
            after = self._counters()
            if after.get("dynamo_cache_error", 0) > self._before.get("dynamo_cache_error", 0):
                logger.warning(
                    "compile cache: the entry in %s failed to load (see above); "
                    "it was compiled again and is rewritten",
                    self.folder,
                )
            elif self._hit() and self._traced() > self._traced_before:
                logger.warning(
                    "compile cache: the entry in %s loaded, but %d graphs were traced "
                    "again (their loaded guards did not match); it is rewritten",
                    self.folder,
                    self._traced() - self._traced_before,
                )

    def _hit(self) -> bool:
        return self._counters().get("dynamo_cache_hit", 0) > self._before.get("dynamo_cache_hit", 0)

    def fully_loaded(self) -> bool:
        """Inside `session()`: whether every compiled function so far came from this folder
        (a package each: the layer groups) and no graph was traced after all (a loaded
        guard that never matches traces again, silently)."""
        missed = self._counters().get("dynamo_cache_miss", 0) > self._before.get(
            "dynamo_cache_miss", 0
        )
        return self._hit() and not missed and self._traced() == self._traced_before

    def save(self) -> None:
        """Write the packages compiled in this session (call inside `session()`)."""
        from torch._dynamo.precompile_context import PrecompileContext

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            PrecompileContext.save_to_dynamo_cache()
            tmp = self.folder / "key.json.tmp"
            tmp.write_text(json.dumps({"key": self.key, **self.parts}, indent=1))
            tmp.replace(self.folder / "key.json")
        except Exception:
            logger.warning(
                "compile cache: could not save to %s; the next start compiles again",
                self.folder,
                exc_info=True,
            )
        finally:
            PrecompileContext.clear()

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def compile_cached(
    name: str, settings: dict[str, Any], sources: list[Path], build: Callable[[], float]
) -> tuple[float, bool]:
    """Run `build` (compiles graphs other than the model's, e.g. the sampler's row kernels,
    and returns seconds) inside a compile cache session of its own, keyed by `name`,
    `settings`, the `sources` it traces, torch, Python, the CPU and the thread count, so a
    warm start loads those graphs instead of tracing them again. Returns (seconds, loaded).
    With the cache off it just runs `build`."""
    if not compile_cache_enabled():
        return build(), False
    h = hashlib.sha256()
    for path in sorted(sources):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    parts = {
        "format": _CACHE_FORMAT,
        "name": name,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu": hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "source": h.hexdigest()[:16],
        "settings": {k: repr(v) for k, v in sorted(settings.items())},
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    cache = CompileCache(CompileCache.root(), key, parts)
    with cache.session():
        seconds = build()
        if not cache.fully_loaded():
            cache.save()
    return seconds, cache.loaded
