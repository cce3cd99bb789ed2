"""The bulk process (``service.bulk_process``): ``python -m service.bulk_child SOCKET``, its
settings on stdin, started by a serving process that forwards its bulk requests here."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading

from service.settings import KEEP_ALIVE_SECONDS, Settings

# The bulk process's nice value: where the cores are short, the scheduler gives them to the
# serving process (the priority class) first, and bulk work the rest.
NICENESS = 10


def _exit_with_parent(orphaned: threading.Event) -> None:
    """Block until stdin closes (the serving process exited, however), then stop."""
    sys.stdin.buffer.read()
    orphaned.set()
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    """Serve the app on the Unix socket ``argv[1]`` until stdin closes or SIGTERM."""
    import uvicorn

    from service.app import create_app
    from service.health import steady_process

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = dataclasses.replace(
        Settings(**json.loads(sys.stdin.readline())),
        bulk_process=False,
        auto_migrate=False,  # the serving process did
        maintenance="worker",  # the periodic tasks are the serving process's
        rate_limit_per_second=0,  # the serving process admitted the request
        max_expensive_per_token=0,
        max_bulk_in_flight=0,
        token_cache_seconds=0,  # a token revoked through the serving process: refused here too
    )
    orphaned = threading.Event()
    threading.Thread(
        target=_exit_with_parent, args=(orphaned,), name="exit-with-parent", daemon=True
    ).start()
    app = create_app(settings)
    steady_process()
    os.nice(NICENESS)  # after its start, which a saturated machine must not hold back
    # Uvicorn stops on SIGTERM, then raises it again with the handler it found: this one
    # ends the process by an exception, through the ``finally`` below.
    signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        uvicorn.run(
            app, uds=argv[1], log_level="warning", timeout_keep_alive=2 * KEEP_ALIVE_SECONDS
        )
    finally:
        if orphaned.is_set():  # the serving process is gone: its socket's directory is ours
            shutil.rmtree(os.path.dirname(argv[1]), ignore_errors=True)
    return 0


def exit_on_signal(number: int, _: object) -> None:
    """A signal handler that ends the process by ``SystemExit``, through its ``finally``s
    (``ckpt server`` uses it too, for its metrics directory)."""
    raise SystemExit(128 + number)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
