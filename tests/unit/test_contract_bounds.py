"""The contract's bounds agree with the agent: every dtype the agent writes is one the
contract accepts, and what the agent writes into a manifest passes the bounds."""

from __future__ import annotations

import torch

from agent.catalog.manifests import versions
from agent.format import payload
from agent.format.dtypes import DTYPES
from ckpt.core.contract import DTYPE_CODES, TensorEntry, Versions


def test_the_contract_knows_every_dtype_of_the_agent() -> None:
    assert sorted(DTYPES.values()) == sorted(DTYPE_CODES)


def test_what_the_agent_writes_passes_the_bounds() -> None:
    assert Versions.model_validate(versions().model_dump()) == versions()
    tensors = {str(dtype): torch.zeros((2, 3), dtype=dtype) for dtype in DTYPES}
    for entry in payload.layout({}, tensors).index.values():
        assert TensorEntry.model_validate(entry.model_dump()) == entry
