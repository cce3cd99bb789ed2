"""``ckpt import`` through a real ``ckpt server``: the imported, partial bundle is
committed by the control plane, which records it so (the REST answer, ``ckpt bundle``),
answers it as the run's resumable bundle, the dashboard's bundle page says so, and a ``Checkpointer`` resumes it through the
control plane; a bundle whose missing layers were not accepted is never committed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from agent.checkpointer import Checkpointer
from ckpt.cli import main as cli
from tests.integration.dcp_writer import model_and_optimizer
from tests.server_process import ckpt_server
from tests.ui.signin import signed_in_client

pytestmark = pytest.mark.slow


def test_an_imported_partial_bundle_is_committed_and_shown_as_such(
    tmp_path: Path, database_url: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    model, optimizer = model_and_optimizer()
    source = tmp_path / "state.pt"
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}, source
    )
    with ckpt_server(tmp_path, database_url=database_url) as server:
        where = ["--server", server.url, "--token", server.token, "--store", server.store]
        refused = cli(["import", str(source), "--run", "refused", *where])
        assert refused == 1 and "--accept-missing scheduler,rng,data" in capsys.readouterr().err
        with server.client() as client:
            assert client.get("/v1/runs/refused/resumable").status_code == 404
        accepted = ["--accept-missing", "scheduler,rng,data"]
        assert cli(["import", str(source), "--run", "pt", *where, *accepted]) == 0
        assert "imported, partial" in capsys.readouterr().out
        with server.client() as client:
            resumable = client.get("/v1/runs/pt/resumable").json()
            bundle = client.get(f"/v1/bundles/{resumable['bundle_id']}").json()
        assert (resumable["step"], bundle["status"], bundle["partial"]) == (3, "complete", True)
        assert bundle["imported"]["missing"] == ["scheduler", "rng", "data"]
        assert bundle["manifest"]["imported"] == bundle["imported"]
        assert bundle["missing_layers"] == []
        assert (
            cli(["bundle", str(bundle["id"]), "--server", server.url, "--token", server.token]) == 0
        )
        assert "imported, partial (no scheduler, rng, data)" in capsys.readouterr().out
        with signed_in_client(server.url, server.token) as browser:
            page = browser.get(f"/ui/runs/pt/bundles/{bundle['id']}").text
        assert 'id="imported"' in page and "partial: it has no scheduler, rng, data" in page
        assert 'id="missing"' not in page
        fresh = nn.Linear(4, 6)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        with Checkpointer(
            run="pt",
            models=fresh,
            optimizers=fresh_optimizer,
            store=server.store,
            server=server.url,
            token=server.token,
            quiet=True,
            handle_signals=False,
        ) as checkpointer:
            result = checkpointer.resume()
            checkpointer.end()
    assert [str(x) for x in result.layers] == ["weights", "optimizer", "counters"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
