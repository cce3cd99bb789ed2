"""Names, texts and numbers that reach object keys, URLs, logs and columns, validated once."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from ckpt.core.contract import MAX_STEP, PRINTABLE
from ckpt.core.storage.keys import check_run_name

__all__ = ["MAX_STEP", "PRINTABLE"]

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

RunName = Annotated[str, Field(max_length=128), AfterValidator(check_run_name)]
# A label a client gives (a token's name) and a reason it states (why a bundle was
# quarantined): printable text of bounded length, safe to log and to show.
Label = Annotated[str, Field(min_length=1, max_length=128, pattern=PRINTABLE)]
Reason = Annotated[str, Field(min_length=1, max_length=2000, pattern=PRINTABLE)]

# Catalog ids are 32-bit integers; byte counts signed 64-bit; steps at most MAX_STEP (2**40).
MAX_ID = 2**31 - 1
# strict: "30" is not a step, nor true a world size
Id = Annotated[int, Field(ge=1, le=MAX_ID, strict=True)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP, strict=True)]
