"""The simulator's layering: blockpool and scheduler only, never torch or the runtime.

`pagemill plan` must answer on a laptop without a GPU stack, and the simulator must drive the
real scheduler, not a model runner; matplotlib is allowed only inside functions (lazily).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pagemill.server.sim as sim

ALLOWED_PAGEMILL = ("pagemill.blockpool", "pagemill.scheduler", "pagemill.server.sim")


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
