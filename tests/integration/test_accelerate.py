"""A bare Accelerator loop with ``ckpt.integrations.accelerate``, killed mid-run (SIGKILL)
and resumed in a fresh process, equals the uninterrupted run bit for bit: parameters,
optimizer state, learning rate and the losses of every micro-batch after the resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from ckpt.integrations.accelerate import checkpointer
from tests.conftest import run_trainer

JOB = "tests.integration.accelerate_trainer"


@pytest.mark.slow
def test_an_accelerator_loop_killed_mid_run_resumes_bit_exactly(tmp_path: Path) -> None:
    reference = run_trainer(tmp_path / "a", tmp_path / "a.pt", "--steps", "8", module=JOB)
    store = tmp_path / "b"
    run_trainer(store, tmp_path / "killed.pt", "--steps", "8", "--kill-at", "5", expect_rc=-9, module=JOB)  # fmt: skip
    resumed = run_trainer(store, tmp_path / "b.pt", "--steps", "8", module=JOB)

    assert reference["resumed_from"] is None and resumed["resumed_from"] == 4
    assert resumed["positions"][0] == (4, 0)  # steps 4 and 5 trained again, from the bundle
    for part in ("model", "optimizer"):
        assert sorted(resumed[part]) == sorted(reference[part])
        for key, value in reference[part].items():
            assert torch.equal(resumed[part][key], value), f"{part} {key}"
    assert resumed["lr"] == reference["lr"]
    after = reference["positions"].index((4, 0))
    assert reference["positions"][after:] == resumed["positions"]
    assert torch.equal(reference["losses"][after:], resumed["losses"])


def test_the_training_objects_come_from_the_accelerator(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=r"call accelerator\.prepare"):
        checkpointer(accelerator, run="r", store=str(tmp_path))
    model = accelerator.prepare(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="leave out models"):
        checkpointer(accelerator, run="r", store=str(tmp_path), models=model)
