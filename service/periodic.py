"""The control plane's periodic tasks: marking lost attempts, garbage collection and the
scrubber.

They run inside the API server (``CKPT_MAINTENANCE=inline``, the default: one process, as
the embedded server wants) or in a process of their own, ``ckpt worker``
(``CKPT_MAINTENANCE=worker`` on the servers, which then run none): a GC pass over a large
catalog then takes no interpreter time from the requests. Either way one pass of GC and of
the scrubber runs at a time across every process (``maintenance.service.exclusive``), so
servers left inline beside a worker are safe, merely redundant.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from service.context import Context
from service.gc import service as gc
from service.runs import attempts
from service.scrub import service as scrub
from service.settings import Settings

log = logging.getLogger("ckpt.service")


@dataclass(frozen=True)
class Periodic:
    what: str
    work: Callable[[Context], object]
    every: float  # seconds between the end of a pass and the start of the next


def periodic_tasks(settings: Settings, *, halt: threading.Event) -> list[Periodic]:
    """The tasks ``settings`` turn on; ``halt`` ends a long pass (the scrubber's) early."""
    tasks = [Periodic("marking lost attempts", attempts.mark_lost, settings.lost_check_seconds)]
    if settings.gc_interval_seconds > 0:
        tasks.append(Periodic("garbage collection", gc.collect, settings.gc_interval_seconds))
    if settings.scrub_interval_seconds > 0:
        work = functools.partial(scrub.scrub, halt=halt)
        tasks.append(Periodic("scrubbing", work, settings.scrub_interval_seconds))
    return tasks


def run_once(task: Periodic, context: Context) -> None:
    """One pass; a failure is logged and the next pass tries again."""
    try:
        task.work(context)
    except Exception:
        log.exception("periodic %s failed", task.what)


def work_until(context: Context, stop: threading.Event) -> None:
    """``ckpt worker``: run every task on its own thread, each pass ``every`` seconds after
    the last one ended, until ``stop`` is set; a pass in flight then ends (the scrubber's
    early) before this returns."""
    tasks = periodic_tasks(context.settings, halt=stop)

    def loop(task: Periodic) -> None:
        while not stop.wait(task.every):
            run_once(task, context)

    threads = [
        threading.Thread(target=loop, args=(task,), name=f"ckpt-{task.what}") for task in tasks
    ]
    for thread in threads:
        thread.start()
    log.info("worker: %s", ", ".join(f"{t.what} every {t.every:g} s" for t in tasks))
    for thread in threads:
        thread.join()
