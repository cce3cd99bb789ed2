"""Names that reach object keys and URLs, validated once: run names."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from ckpt.core.storage.keys import check_run_name

# No control characters (Postgres text cannot hold NUL; logs should not hold the others).
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

RunName = Annotated[str, Field(max_length=128), AfterValidator(check_run_name)]

# Catalog ids are 32-bit integers; steps and byte counts signed 64-bit.
MAX_ID = 2**31 - 1
MAX_STEP = 2**62
# strict: "30" is not a step, nor true a world size
Id = Annotated[int, Field(ge=1, le=MAX_ID, strict=True)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP, strict=True)]
