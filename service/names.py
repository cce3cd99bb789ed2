"""Names that reach object keys and URLs, validated once: run names."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from agent.storage.keys import check_run_name

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

RunName = Annotated[str, Field(max_length=128), AfterValidator(check_run_name)]
