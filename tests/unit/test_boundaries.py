"""Import boundaries: a training image needs no web stack, the control plane no torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def test_exactly_one_module_imports_boto3() -> None:
    root = Path(__file__).resolve().parents[2]
    importers = sorted(
        str(path.relative_to(root))
        for package in ("agent", "service")
        for path in (root / package).rglob("*.py")
        if re.search(r"^\s*(import|from) (boto3|botocore)\b", path.read_text(), re.MULTILINE)
    )
    assert importers == ["agent/storage/s3.py"]


def test_the_agent_loads_boto3_only_for_an_s3_store() -> None:
    modules = loaded_after("import agent.storage; agent.storage.open_store('/tmp/x')")
    assert "boto3" not in modules
