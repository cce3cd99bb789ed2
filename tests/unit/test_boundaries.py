"""Import boundaries: a training image needs no web stack, the control plane no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


@pytest.mark.parametrize("forbidden", ["fastapi", "sqlalchemy", "starlette", "uvicorn", "boto3"])
def test_the_agent_loads_no_web_stack(forbidden: str) -> None:
    modules = loaded_after("import agent, agent.demo.train")
    assert "torch" in modules
    assert forbidden not in modules


@pytest.mark.parametrize(
    "statement",
    [
        "import service",
        "import service.contract",
        "import service.cli",
        "import service.app",
        "import service.rebuild",
        "import service.gc.service",
    ],
)
def test_the_service_loads_no_torch(statement: str) -> None:
    modules = loaded_after(statement)
    assert "torch" not in modules
    assert "numpy" not in modules
