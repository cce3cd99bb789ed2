"""How the ``ckpt`` command ends when a command fails.

An error the user can act on (no credentials for the store, a dead server, a bad token, a
full disk, a catalog database that does not answer) ends the command with one or two lines
naming what to fix, and exit status 1; the traceback only with ``--debug`` or
``CKPT_DEBUG=1``. Anything else is a bug: its traceback is printed as Python would. A
reader that closes the pipe early (``ckpt token list --json | head -1``) ends the command
quietly. Every line printed here has its secrets cut (``ckpt.core.redact``).
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from collections.abc import Callable

from ckpt.core.errors import CkptError
from ckpt.core.redact import redact

DEBUG_VARIABLE = "CKPT_DEBUG"
# What a process killed by SIGPIPE returns in a shell (128 + 13).
BROKEN_PIPE_STATUS = 141
# Operating-system errors a user fixes outside the program: space, permissions, a port.
_ACTIONABLE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EADDRINUSE,
    errno.ENOENT,
}


def debugging(flag: bool = False) -> bool:
    """Whether tracebacks are wanted: ``--debug`` or ``CKPT_DEBUG`` set to anything but 0."""
    return flag or os.environ.get(DEBUG_VARIABLE, "").strip() not in ("", "0")


def run(command: str, body: Callable[[], int], *, debug: bool) -> int:
    """``body()``'s exit status; an actionable error printed in short, a closed pipe quietly."""
    try:
        return body()
    except BrokenPipeError:
        return _closed_pipe()
    except Exception as err:
        message = actionable(err)
        if message is None:
            raise
        if debugging(debug):
            traceback.print_exc()
        print(redact(f"{command}: {message}"), file=sys.stderr)
        if not debugging(debug):
            print(f"(the traceback: {DEBUG_VARIABLE}=1 or ckpt --debug)", file=sys.stderr)
        return 1


def actionable(err: BaseException) -> str | None:
    """The one-line message of an error the user can act on; None for anything else."""
    if isinstance(err, CkptError):
        return _one_line(str(err))
    service_errors = sys.modules.get("service.errors")
    if service_errors is not None and isinstance(err, service_errors.ServiceError):
        return None if type(err) is service_errors.ServiceError else _one_line(str(err))
    database = _database_error(err)
    if database is not None:
        return database
    if isinstance(err, OSError) and err.errno in _ACTIONABLE_ERRNOS:
        return _one_line(str(err))
    return None


def _database_error(err: BaseException) -> str | None:
    """A database that refused the connection or the statement, as its driver says it."""
    exc = sys.modules.get("sqlalchemy.exc")
    if exc is None or not isinstance(err, exc.OperationalError):
        return None
    said = _one_line(str(err.orig)) if err.orig is not None else _one_line(str(err))
    return f"the catalog database failed: {said} (check CKPT_DATABASE_URL)"


def _one_line(text: str) -> str:
    """The first non-empty line of ``text``."""
    return next((line.strip() for line in text.splitlines() if line.strip()), text.strip())


def _closed_pipe() -> int:
    """The reader went away: point stdout at /dev/null so that the interpreter's final flush
    raises nothing (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return BROKEN_PIPE_STATUS
