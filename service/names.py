"""Names, texts and numbers that reach object keys, URLs, logs and columns, validated once."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, Field

from ckpt.core.contract import MAX_STEP, PRINTABLE, check_visible
from ckpt.core.storage.keys import check_run_name

__all__ = ["MAX_STEP", "PRINTABLE"]

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

# The characters a reader cannot see (ckpt.core.contract.HIDDEN_CATEGORIES, Unicode's Cc, Cf,
# Zl, Zp and Cs) as a regular expression's character class; among them the bidirectional
# controls (U+202A-U+202E, U+2066-U+2069, U+200E, U+200F, U+061C), which reorder the text
# around them. A name holding one is refused (check_visible); a free text holding one is
# kept, and shown and logged with each written as an escape (service/logsafe.py).
# tests/service/test_bounds.py checks the class against the running Python's Unicode data.
HIDDEN_BEYOND_C0 = (
    "\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f"
)
HIDDEN = "\x00-\x1f" + HIDDEN_BEYOND_C0

RunName = Annotated[str, Field(max_length=128), AfterValidator(check_run_name)]
# A name a client gives (a token's name, a pod's): visible characters only, bounded.
Hostname = Annotated[
    str, Field(min_length=1, max_length=253, pattern=PRINTABLE), AfterValidator(check_visible)
]
Label = Annotated[
    str, Field(min_length=1, max_length=128, pattern=PRINTABLE), AfterValidator(check_visible)
]
# A reason a client states (why a bundle was quarantined): printable text of bounded length,
# kept as given; the pages and the logs show its hidden characters as escapes.
Reason = Annotated[str, Field(min_length=1, max_length=2000, pattern=PRINTABLE)]

# Catalog ids are 32-bit integers; byte counts signed 64-bit; steps at most MAX_STEP (2**40).
MAX_ID = 2**31 - 1
# strict: "30" is not a step, nor true a world size
Id = Annotated[int, Field(ge=1, le=MAX_ID, strict=True)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP, strict=True)]
MAX_RANK = 16383  # world sizes go up to 16384
Rank = Annotated[int, Field(ge=0, le=MAX_RANK, strict=True)]

# A resume's verdict on the steps it replayed (agent.verify.compare.Verdict's values).
Verdict = Literal["verified", "diverged", "unverifiable"]
VERDICTS: tuple[str, ...] = get_args(Verdict)
