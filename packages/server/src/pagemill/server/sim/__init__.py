"""Capacity planner and GPU-scale serving simulator (`pagemill plan`, `pagemill simulate`).

Pure Python on top of pagemill.blockpool and pagemill.scheduler: no torch, no GPU. The planner
is roofline arithmetic on model shapes and GPU datasheets (shipped as JSON under ``data/``);
the simulator drives the real scheduler and block pool with a virtual clock and a fake model
whose step time comes from the same roofline.
"""

from pagemill.server.sim.cost_model import RooflineCostModel, StepCost
from pagemill.server.sim.experiments import (
    EXPERIMENTS,
    Comparison,
    default_workloads,
    prefix_caching,
    run_experiments,
    static_vs_paged,
    token_budget,
)
from pagemill.server.sim.hardware import Deployment
from pagemill.server.sim.metrics import RunResult, percentile
from pagemill.server.sim.paged_sim import PagedSimulator
from pagemill.server.sim.plan import CapacityPlan, estimate_activation_bytes, format_plan, make_plan
from pagemill.server.sim.replicas import ROUTERS, ReplicaRun, ReplicaSimulator, compare_routers
from pagemill.server.sim.specs import (
    GPUSpec,
    ModelSpec,
    known_gpus,
    known_models,
    load_gpu,
    load_model,
    model_from_hf_config,
)
from pagemill.server.sim.static_sim import StaticBatchSimulator
from pagemill.server.sim.workload import (
    ChatSpec,
    LengthDist,
    SimRequest,
    WorkloadSpec,
    generate_chat_workload,
    generate_workload,
)

__all__ = [
    "EXPERIMENTS",
    "ROUTERS",
    "CapacityPlan",
    "ChatSpec",
    "Comparison",
    "Deployment",
    "GPUSpec",
    "LengthDist",
    "ModelSpec",
    "PagedSimulator",
    "ReplicaRun",
    "ReplicaSimulator",
    "RooflineCostModel",
    "RunResult",
    "SimRequest",
    "StaticBatchSimulator",
    "StepCost",
    "WorkloadSpec",
    "compare_routers",
    "default_workloads",
    "estimate_activation_bytes",
    "format_plan",
    "generate_chat_workload",
    "generate_workload",
    "known_gpus",
    "known_models",
    "load_gpu",
    "load_model",
    "make_plan",
    "model_from_hf_config",
    "percentile",
    "prefix_caching",
    "run_experiments",
    "static_vs_paged",
    "token_budget",
]
