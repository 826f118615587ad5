"""The simulator's layering: blockpool and scheduler, plus the torch-free modules it shares
with the engine (config.json parsing and dtype names, config-derived flags); never torch or
the engine itself.

`pagemill plan` must answer on a laptop without a GPU stack, and the simulator must drive the
real scheduler, not a model runner; matplotlib is allowed only inside functions (lazily).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pagemill.server.sim as sim

ALLOWED_PAGEMILL = (
    "pagemill.blockpool",
    "pagemill.scheduler",
    "pagemill.server.sim",
    "pagemill.server.config_args",
    "pagemill.runtime.model_config",
    "pagemill.runtime.moe_config",
    # `simulate --replicas`: the routing policies' names, and (lazily) the engine's own
    # router and KV-event wire classes, both torch-free.
    "pagemill.runtime.config",
    "pagemill.runtime.engine.dp_router",
    "pagemill.runtime.engine.kv_events",
    # Only inside `simulate --html` (lazily): the dashboard's picture and page, no torch.
    "pagemill.server.dashboard.replay",
    "pagemill.server.dashboard.cores",
    "pagemill.server.dashboard.snapshot",
)


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(module, at top level) for every import in a module."""
    top = {id(node) for node in getattr(tree, "body", [])}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, id(node) in top))
    return found


def test_sim_imports_only_blockpool_scheduler_and_stdlib() -> None:
    files = sorted(Path(sim.__file__).parent.glob("*.py"))
    assert len(files) > 5
    for path in files:
        for module, top_level in _imports(ast.parse(path.read_text())):
            root = module.split(".")[0]
            if root == "pagemill":
                assert module.startswith(ALLOWED_PAGEMILL), f"{path.name} imports {module}"
            elif root == "matplotlib":
                assert not top_level, f"{path.name} imports matplotlib at module level"
            else:
                assert root in sys.stdlib_module_names or root == "__future__", (
                    f"{path.name} imports {module}"
                )


def test_planner_and_shared_config_modules_never_load_torch() -> None:
    # A fresh interpreter: this test session has long imported torch. The shared modules are
    # imported through their packages' __init__ files, which must stay lazy for this to hold.
    code = (
        "import sys\n"
        "import pagemill.server.sim, pagemill.server.sim.cli, pagemill.server.config_args\n"
        "import pagemill.runtime.model_config, pagemill.runtime.config, pagemill.server.cli\n"
        "from pagemill.runtime import DEFAULT_MODEL, EngineConfig, ModelConfig\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'pagemill.runtime.engine',\n"
        "                           'pagemill.kernels') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
