"""``every="auto"`` asks the control plane for its estimate of the time between preemptions
from the training loop; while the control plane holds connections without answering, the
loop gets the last estimate back at once instead of waiting on the request."""

from __future__ import annotations

import time

from agent.catalog.client import TRY_SECONDS, ControlPlane
from agent.catalog.control_plane import ControlPlaneCatalog
from agent.ranks.base import SingleProcess
from tests.fault_proxy import FaultProxy, Faults
from tests.service.conftest import MakeServer


def test_a_black_holed_control_plane_does_not_hold_the_estimate(
    make_server: MakeServer, run_name: str
) -> None:
    server = make_server("sqlite")
    faults = Faults(stall_seconds=3 * TRY_SECONDS)
    proxy = FaultProxy(server.url, faults)
    catalog = ControlPlaneCatalog(
        ControlPlane(proxy.url, token=server.admin_token, retry_seconds=60.0),
        run=run_name,
        heartbeat_seconds=3600.0,
        step=lambda: 0,
        ranks=SingleProcess(),
        store=server.store,
    )
    try:
        catalog.resumable(run_name, own=True)  # registers the attempt
        first = catalog.preemption_rate()  # waits a while for the first answer only
        deadline = time.monotonic() + 120  # a busy machine: ask until it answers
        while first is None and time.monotonic() < deadline:
            first = catalog.preemption_rate()
        assert first is not None and first > 0
        faults.rates["stall"] = 1.0  # every connection held, never answered
        started = time.monotonic()
        again = catalog.preemption_rate()
        took = time.monotonic() - started
    finally:
        faults.rates.clear()
        catalog.close()
        proxy.close()
    assert again == first  # the last estimate: the loop did not wait for the new one
    assert took < TRY_SECONDS / 2
