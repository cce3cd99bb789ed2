"""Garbage collection logs a pass that did something, and says nothing of an idle one (the
server runs one every ten minutes), on PostgreSQL and SQLite."""

from __future__ import annotations

import logging

import pytest

from service.gc.service import collect
from tests.service.conftest import MakeServer
from tests.service.helpers import register
from tests.service.test_gc import save_steps, set_keep


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def test_an_idle_pass_logs_nothing_and_a_pass_that_deleted_logs_one_line(
    make_server: MakeServer, backend: str, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(backend)
    with server.client() as client:
        attempt = register(client, run_name)
        save_steps(server, client, run_name, attempt, [1, 2, 3])
        with caplog.at_level(logging.INFO, logger="ckpt.gc"):
            for _ in range(2):  # nothing to delete: no policy, every blob referenced
                assert collect(server.context).deleted_bundles == []
            idle = [r for r in caplog.records if r.name == "ckpt.gc"]
            set_keep(client, run_name, keep_last=1)
            report = collect(server.context)
        busy = [r for r in caplog.records if r.name == "ckpt.gc"][len(idle) :]
    assert idle == []
    assert len(report.deleted_bundles) == 2
    assert [r.levelno for r in busy] == [logging.INFO]
    assert '"deleted_bundles":[' in busy[0].getMessage()
