"""The CUDA paths: GPU tensors and every device's RNG. Skipped where there is no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt import Checkpointer
from ckpt.core.storage import DirectoryStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def build(store: Path) -> tuple[Checkpointer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer(run="cuda", store=DirectoryStore(store), models=model, optimizers=optimizer)
    return ckpt, model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    loss: torch.Tensor = model(torch.randn(4, 8, device="cuda")).square().mean()
    torch.autograd.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def test_gpu_state_and_every_device_rng_resume_exactly(tmp_path: Path) -> None:
    ckpt, model, optimizer = build(tmp_path)
    for _ in range(3):
        step(model, optimizer)
    ckpt.counters.step = 3
    ckpt.save().wait()
    expected = [step(model, optimizer) for _ in range(3)]

    fresh, restored_model, restored_optimizer = build(tmp_path)
    torch.cuda.manual_seed_all(12345)  # the resume must overwrite this
    fresh.resume()
    assert all(p.is_cuda for p in restored_model.parameters())
    assert torch.equal(
        torch.stack(expected),
        torch.stack([step(restored_model, restored_optimizer) for _ in range(3)]),
    )
    for a, b in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_mid_accumulation_gradients_come_back_on_the_device(tmp_path: Path) -> None:
    ckpt, model, _ = build(tmp_path)
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    ckpt.counters.micro_step = 1
    ckpt.save().wait()
    fresh, restored, _ = build(tmp_path)
    fresh.resume()
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert b.grad is not None and b.grad.is_cuda
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
