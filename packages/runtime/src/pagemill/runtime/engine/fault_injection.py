"""Fault injection for drills and tests, through public seams only.

Nothing in the engine knows about this module: a fault is injected by replacing the engine
core's public `model_runner` with `FaultyModelRunner`, a double that runs the real runner
and then raises whatever its `fault` callable returns for the step (so the runner's own
state follows the step exactly as when a real forward raises). The engine core's fault
isolation (`pagemill.runtime.engine.fault_isolation`) then handles it like any other failed step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagemill.runtime.worker.model_runner import ModelRunnerOutput
    from pagemill.scheduler import SchedulerOutput

Fault = Callable[["SchedulerOutput"], BaseException | None]
"""Given a step's SchedulerOutput, the exception its forward should raise (None: none)."""


class FaultyModelRunner:
    """A model-runner double: `execute_model` runs the wrapped runner, then raises
    `fault(output)` when that is not None. Every other attribute is the wrapped runner's."""

    def __init__(self, runner: Any, fault: Fault) -> None:
        self.runner = runner
        self.fault = fault

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        result: ModelRunnerOutput = self.runner.execute_model(scheduler_output)
        exc = self.fault(scheduler_output)
        if exc is not None:
            raise exc
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class TokenFault:
    """A `Fault`: RuntimeError(message) for every step with `token_id` among its input ids.

    A class (not a closure) so that it pickles into an engine process.
    """

    def __init__(
        self, token_id: int, message: str = "injected fault: a poisoned token in the batch"
    ) -> None:
        self.token_id = token_id
        self.message = message

    def __call__(self, scheduler_output: SchedulerOutput) -> BaseException | None:
        token = self.token_id
        if any(token in s.token_ids for s in scheduler_output.scheduled):
            return RuntimeError(self.message)
        return None


def inject_fault(engine: object, fault: Fault) -> None:
    """Wrap the model runner of `engine` (an LLMEngine or an EngineCore) in a
    FaultyModelRunner raising what `fault` returns."""
    core: Any = getattr(engine, "engine_core", engine)
    core.model_runner = FaultyModelRunner(core.model_runner, fault)


def inject_token_fault(
    engine: object, token_id: int, message: str = "injected fault: a poisoned token in the batch"
) -> None:
    """Make `engine`'s steps raise RuntimeError(message) whenever `token_id` is an input.

    For fault-injection drills and tests (picklable with functools.partial, so it also
    runs in an engine process through `client.submit`). `message` containing "CUDA error"
    simulates a device error, which is not containable. Returns None (picklable result).
    """
    inject_fault(engine, TokenFault(token_id, message))
