"""The model's forward as a compiled graph on CPU (torch.compile, inductor).

An eager decode step is ~1,800 small ops, each paying Python and dispatcher overhead, and
at batch 1 that overhead is most of the step. Compiled, the norms, rotary, activations and
residual adds fuse into a few C++ loops, and with `freezing` the linear weights are
prepacked for oneDNN once. The KV write and paged attention are custom ops
(`pagemill.kernels.ops`), so the graph never breaks at them; the attention plan crosses
it as an opaque object.

Shapes: the token dimension is dynamic, so one graph serves every batch size and prefill
chunk (torch specializes size 1, the decode of a single request, into a second graph);
there is nothing to recompile per batch size, which is what bucketing would otherwise
bound. Guards: dynamo would check every parameter and module attribute on every call
(~3,700 guards, ~3 ms a step); the model does not change between steps, so only the
inputs' guards are kept. Every graph is compiled at start-up. Inductor's on-disk cache
(under pagemill's cache folder unless TORCHINDUCTOR_CACHE_DIR says otherwise) keeps the
generated code, so a later start skips code generation and C++ builds; dynamo's trace and
AOT's graph preparation still run each start (~50 s for SmolLM2 on 2 cores, measured).
"""

from __future__ import annotations

import logging
import os
import shutil
import types
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Set (to 1) to make `enforce_eager` the default, e.g. for a test suite that builds many
# engines and only wants to pay for compilation in the tests about it.
ENFORCE_EAGER_ENV = "PAGEMILL_ENFORCE_EAGER"

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
        return (f"torch {torch.__version__} cannot pass the attention plan through a "
                "compiled graph (needs torch's opaque custom classes)")
    if _cxx_compiler() is None:
        return ("no C++ compiler found (inductor needs g++ or clang++; install one, "
                "e.g. `apt-get install g++`, or set CXX)")
    return None


def _keep_input_guards(guards: list[Any]) -> list[bool]:
    """Keep the guards on the forward's inputs (shapes, dtypes) and on symbolic sizes (a
    layer may branch on the token count, e.g. packed vs dense weights); drop the model's
    own (parameters, modules, globals), which do not change between steps."""
    return [g.guard_type == "SHAPE_ENV" or g.name.split(".")[0].split("[")[0] in _INPUTS
            for g in guards]


def _private_forward(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`model.forward` bound over a private copy of its code object.

    Dynamo keeps compiled graphs on the code object, shared by every instance of the class,
    and the model's own guards are dropped (`_keep_input_guards`): a second model in this
    process (another engine, another weight format) would run the first one's graph —
    its weight formats, its branches. A code object of its own gives each model its own
    cache.
    """
    forward = type(model).forward
    private = types.FunctionType(forward.__code__.replace(), forward.__globals__,
                                 forward.__name__, forward.__defaults__, forward.__closure__)
    private.__kwdefaults__ = forward.__kwdefaults__
    return types.MethodType(private, model)


def compile_forward(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The compiled `model.forward` (compiles lazily, on the first call of each graph)."""
    from pagemill.kernels import ops  # noqa: F401 - registers the custom ops

    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from pagemill.runtime.model_executor.default_model import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return torch.compile(
        _private_forward(model),
        dynamic=True,
        fullgraph=True,
        options={"freezing": True, "guard_filter_fn": _keep_input_guards},
    )
