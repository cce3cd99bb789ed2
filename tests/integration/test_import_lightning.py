"""A Lightning ``.ckpt`` imported into a run, then fit by ckpt's Lightning integration,
against Lightning's own resume (``fit(ckpt_path=...)``) from the same file.

Lightning's ``ModelCheckpoint`` writes the file at the end of the first epoch. It saves
neither the RNG nor a data position, so the import accepts both as missing: the resumed
process keeps its own random streams (seeded alike in both resumes, as Lightning's own
resume does) and starts the next epoch's loader from its first batch, as Lightning does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from agent.catalog.manifests import latest_manifest
from agent.interop.importing import import_checkpoint
from ckpt import ResumableSampler
from ckpt.core.contract import Layer
from ckpt.core.errors import ImportSourceError
from ckpt.core.storage import open_store
from ckpt.integrations.lightning import CheckpointCallback
from tests.integration.lightning_trainer import Samples
from tests.integration.test_import_dicts import assert_optimizer_equal, assert_tensors_equal

pytestmark = [
    pytest.mark.slow,
    # Lightning warns about loaders without workers, logging and CPU-only runs.
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

EPOCHS, BATCHES = 3, 10  # 40 samples in batches of 4


class Tiny(pl.LightningModule):
    """No dropout: the losses depend on the weights, optimizer, scheduler and data alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        inputs, labels = batch
        loss = nn.functional.cross_entropy(self.net(inputs), labels)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS * BATCHES)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def loader() -> DataLoader[Any]:
    dataset = Samples(40, 8, 3)
    return DataLoader(dataset, batch_size=4, sampler=ResumableSampler(dataset, shuffle=False))


def fit(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> dict[str, Any]:
    """Fit a fresh module in ``root``; Lightning checkpoints only through ``callbacks``."""
    module = Tiny()
    trainer = pl.Trainer(
        default_root_dir=root,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        max_epochs=EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    torch.manual_seed(99)  # the global streams, alike in every fit (Lightning saves none)
    trainer.fit(module, loader(), **kwargs)
    optimizer = trainer.optimizers[0]
    return {
        "losses": torch.stack(module.losses),
        "model": {k: v.clone() for k, v in module.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "step": trainer.global_step,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``.ckpt`` ModelCheckpoint writes at the end of the first epoch."""
    root = tmp_path_factory.mktemp("lightning")
    fit(root, [ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)])
    return root / f"epoch=0-step={BATCHES}.ckpt"


def test_a_lightning_checkpoint_resumes_under_ckpt_as_under_lightning(
    checkpoint: Path, tmp_path: Path
) -> None:
    theirs = fit(tmp_path, [], ckpt_path=str(checkpoint))
    store = str(tmp_path / "store")
    result = import_checkpoint(checkpoint, run="pl", store=store, accept_missing=["rng", "data"])
    assert (result.step, result.format) == (BATCHES, "lightning")
    assert set(result.missing) == {Layer.RNG, Layer.DATA}
    ours = fit(tmp_path, [CheckpointCallback(run="pl", store=store, every_steps=1000, quiet=True)])
    assert len(theirs["losses"]) == (EPOCHS - 1) * BATCHES
    assert ours["step"] == theirs["step"] == EPOCHS * BATCHES
    assert torch.equal(ours["losses"], theirs["losses"])
    assert_tensors_equal(ours["model"], theirs["model"])
    assert_optimizer_equal(ours["optimizer"], theirs["optimizer"])
    assert ours["scheduler"] == theirs["scheduler"]


def test_missing_layers_are_named_and_nothing_is_committed(
    checkpoint: Path, tmp_path: Path
) -> None:
    store = str(tmp_path / "store")
    with pytest.raises(ImportSourceError, match="--accept-missing rng,data") as refused:
        import_checkpoint(checkpoint, run="pl", store=store, accept_missing=["data"])
    assert "rng: Lightning saves no RNG state" in str(refused.value)
    with pytest.raises(ImportSourceError, match="names optimizer, which the source fills"):
        import_checkpoint(
            checkpoint, run="pl", store=store, accept_missing=["rng", "data", "optimizer"]
        )
    assert latest_manifest(open_store(store), "pl") is None


def test_a_damaged_file_is_refused_by_name(checkpoint: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.ckpt"
    data = checkpoint.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    store = str(tmp_path / "store")
    with pytest.raises(ImportSourceError, match=r"damaged\.ckpt: cannot be read"):
        import_checkpoint(damaged, run="pl", store=store, accept_missing=["rng", "data"])
    assert latest_manifest(open_store(store), "pl") is None
