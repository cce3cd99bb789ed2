"""Import boundaries: one-way layers, no cycles, a training image without the web stack and a
control plane without torch.

The layers, lowest first::

    ckpt.core          the wire contract, storage, errors (pydantic; boto3 for S3)
    agent              the in-job agent (torch)          imports core
    service            the control plane (FastAPI, SQL)  imports core
    migrations         the catalog's schema history      imports service, core
    ckpt.integrations  HF Trainer, Lightning (extras)    imports agent, core
    ckpt.cli, ckpt     the command and the public names  import anything
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ckpt", "agent", "service", "migrations")

ALLOWED = {
    "core": {"core"},
    "agent": {"core", "agent"},
    "service": {"core", "service"},
    "migrations": {"core", "service", "migrations"},
    "integrations": {"core", "agent", "integrations"},
    "cli": {"core", "agent", "service", "migrations", "cli"},
    # ckpt/__init__.py (the public names), ckpt/__main__.py, and the modules that tell an old
    # import (ckpt.agent, ckpt.service, ckpt.migrations) where its package went
    "": {"core", "agent", "cli"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


def imported(path: Path) -> Iterator[str]:
    """Every ``ckpt`` module that ``path`` imports, at any depth of the file (functions and
    ``TYPE_CHECKING`` blocks included): ``from a import b`` names ``a.b`` when that is a module."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in modules() else base


@cache
def graph() -> dict[str, set[str]]:
    return {
        name: {target for target in imported(path) if target in modules() and target != name}
        for name, path in modules().items()
    }


def layer(module: str) -> str:
    top, _, rest = module.partition(".")
    if top != "ckpt":
        return top
    inside = rest.partition(".")[0]
    return inside if inside in ("core", "integrations", "cli") else ""


def test_the_layers_import_one_way() -> None:
    wrong = sorted(
        f"{source} imports {target}"
        for source, targets in graph().items()
        for target in targets
        if layer(target) not in ALLOWED[layer(source)]
    )
    assert not wrong, "\n".join(wrong)


def test_the_layers_are_found() -> None:
    """Guards the test above: it must see the packages and their imports."""
    found = {layer(name) for name in modules()}
    assert found == set(ALLOWED)
    assert "ckpt.core.contract" in graph()["agent.catalog.client"]
    assert "service.models" in graph()["migrations.env"]
    assert "ckpt.core.storage.base" in graph()["ckpt.core.storage.directory"]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


@pytest.mark.parametrize("forbidden", ["fastapi", "sqlalchemy", "starlette", "uvicorn", "boto3"])
def test_the_agent_loads_no_web_stack(forbidden: str) -> None:
    modules = loaded_after("from ckpt import Checkpointer; import agent.demo.train")
    assert "torch" in modules
    assert forbidden not in modules


@pytest.mark.parametrize(
    "statement",
    [
        "import ckpt",
        "import ckpt.core.contract",
        "import ckpt.cli",
        "import service.app",
        "import service.rebuild",
        "import service.gc.service",
        "from ckpt.cli import main; main(['runs', '--help'])",
    ],
)
def test_the_control_plane_and_the_command_load_no_torch(statement: str) -> None:
    modules = loaded_after(f"import contextlib\nwith contextlib.suppress(SystemExit): {statement}")
    assert "torch" not in modules
    assert "numpy" not in modules


def test_the_public_names_resolve() -> None:
    import ckpt

    for name in ckpt.__all__:
        assert getattr(ckpt, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = ckpt.Nope


@pytest.mark.parametrize("package", ["ckpt", "agent", "service"])
def test_the_packages_are_typed(package: str) -> None:
    assert (ROOT / package / "py.typed").is_file()


def test_exactly_one_module_imports_boto3() -> None:
    importers = sorted(
        str(path.relative_to(ROOT))
        for path in modules().values()
        if re.search(r"^\s*(import|from) (boto3|botocore)\b", path.read_text(), re.MULTILINE)
    )
    assert importers == ["ckpt/core/storage/s3.py"]


def test_the_agent_loads_boto3_only_for_an_s3_store() -> None:
    modules = loaded_after("import ckpt.core.storage; ckpt.core.storage.open_store('/tmp/x')")
    assert "boto3" not in modules
