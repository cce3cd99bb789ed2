"""Each cloud's notice probe against a metadata server on 127.0.0.1 that answers in that
cloud's real shapes and refuses requests without its headers (tests/metadata_server.py)."""

from __future__ import annotations

import threading

import httpx
import pytest

from agent.attempt.notices import Aws, Azure, Gcp, Notice, NoticeWatch
from agent.config import Config
from tests.metadata_server import AZURE_FREEZE, metadata_server

CASES = [
    (
        "aws",
        Aws,
        "instance-action",
        Notice("aws", "instance-action", "terminate at 2026-12-01T03:30:00Z"),
    ),
    ("aws", Aws, "rebalance", Notice("aws", "rebalance", "noticed at 2026-12-01T03:25:00Z")),
    ("gcp", Gcp, "preempted", Notice("gcp", "preempted", "instance/preempted is TRUE")),
    ("gcp", Gcp, "maintenance", Notice("gcp", "maintenance", "TERMINATE_ON_HOST_MAINTENANCE")),
    (
        "azure",
        Azure,
        "preempt",
        Notice(
            "azure",
            "preempt",
            "602d9444-d2cd-49c7-8624-8643e7171297 not before Tue, 01 Dec 2026 03:30:00 GMT",
        ),
    ),
]


@pytest.mark.parametrize(("cloud", "probe", "kind", "expected"), CASES)
def test_a_probe_reads_nothing_until_the_cloud_announces(
    cloud: str, probe: type[Aws | Gcp | Azure], kind: str, expected: Notice
) -> None:
    with metadata_server(cloud) as (server, url), httpx.Client() as http:
        reader = probe()
        assert reader.poll(http, url) is None
        assert reader.poll(http, url) is None
        server.announce(kind)
        assert reader.poll(http, url) == expected


def test_aws_asks_for_a_new_token_when_the_old_one_is_refused() -> None:
    with metadata_server("aws") as (server, url), httpx.Client() as http:
        reader = Aws()
        assert reader.poll(http, url) is None
        server.expire_token = True  # the next request with the old token gets 401
        server.announce("instance-action")
        found = reader.poll(http, url)
        assert found is not None and found.kind == "instance-action"


def test_azure_ignores_a_freeze_which_only_pauses_the_machine() -> None:
    with metadata_server("azure") as (server, url), httpx.Client() as http:
        server.extra_events.append(AZURE_FREEZE)
        assert Azure().poll(http, url) is None
        server.announce("preempt")
        found = Azure().poll(http, url)
        assert found is not None and found.kind == "preempt"


def test_a_metadata_service_that_fails_raises_for_the_watch_to_log() -> None:
    with metadata_server("gcp") as (server, url), httpx.Client() as http:
        server.fail = True
        with pytest.raises(httpx.HTTPStatusError):
            Gcp().poll(http, url)


def test_the_watch_polls_until_a_notice_then_reports_it_once_and_stops() -> None:
    with metadata_server("gcp") as (server, url):
        got: list[Notice] = []
        reported = threading.Event()

        def on_notice(notice: Notice) -> None:
            got.append(notice)
            reported.set()

        watch = NoticeWatch(["gcp"], poll_seconds=0.01, url=url, on_notice=on_notice)
        server.fail = True  # a failing service is logged and polled again
        watch.start()
        server.wait_for_requests(3)
        assert watch.take() is None
        server.fail = False
        server.announce("preempted")
        assert reported.wait(30)
        assert got == [Notice("gcp", "preempted", "instance/preempted is TRUE")]
        assert watch.take() == got[0]
        assert watch.take() is None  # once
        # Read within one poll: a GCP poll asks two questions (preempted, then maintenance),
        # and the announcement may fall between them.
        assert server.announced_at_request is not None
        assert server.first_notice_request is not None
        assert server.first_notice_request <= server.announced_at_request + 2
        watch.stop()


def test_the_configuration_names_known_clouds_only() -> None:
    assert Config.resolve({"run": "r"}, {"CKPT_NOTICES": "aws, GCP,aws"}).notices == ("aws", "gcp")
    assert Config.resolve({"run": "r"}, {}).notices == ()
    with pytest.raises(ValueError, match="unknown clouds \\['ibm'\\]"):
        Config.resolve({"run": "r"}, {"CKPT_NOTICES": "aws,ibm"})
    with pytest.raises(ValueError, match="notice_poll_seconds"):
        Config.resolve({"run": "r"}, {"CKPT_NOTICE_POLL_SECONDS": "0"})
    with pytest.raises(ValueError, match="metadata_url"):
        Config.resolve({"run": "r"}, {"CKPT_METADATA_URL": "ftp://x"})
