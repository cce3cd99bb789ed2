"""Where bundles are found, recorded and committed: the store alone or the control plane.

base           the ``Catalog`` protocol that restore and persist talk to
store          store-only: the manifests in the store are the catalog
manifests      the commit records: naming, writing, finding the newest, reading
control_plane  through the control plane (``CKPT_SERVER``): attempts, fencing, lineage
job            a job of many ranks' commit through it, and what an outage defers
client         the control plane's REST calls, with retries
registration   this process's attempt: register (fencing older ones), heartbeat, end
late           a save's calls, each waited for at most twice its patience
figures        a rank's save figures, riding on its next layer record
estimate       the preemption estimate of ``every="auto"``, asked in the background
"""

from __future__ import annotations

from collections.abc import Callable

from agent.catalog.base import Catalog
from agent.catalog.client import ControlPlane
from agent.catalog.control_plane import ControlPlaneCatalog
from agent.catalog.store import StoreCatalog
from agent.config import Config
from agent.ranks.base import Ranks
from ckpt.core.storage import ObjectStore
from ckpt.core.tokens import default_token


def open_catalog(
    config: Config, *, store: ObjectStore, ranks: Ranks, step: Callable[[], int]
) -> Catalog:
    """The control plane's catalog when ``config.server`` names one, else the store's."""
    if not config.server:
        return StoreCatalog(store, run=config.run, ranks=ranks)
    control = ControlPlane(
        config.server,
        token=config.token or default_token(),
        retry_seconds=config.server_retry_seconds,
    )
    return ControlPlaneCatalog(
        control,
        run=config.run,
        heartbeat_seconds=config.heartbeat_seconds,
        step=step,
        ranks=ranks,
        store=store,
    )
