"""How ``ckpt launch`` learns that its trainer finished training, whatever its exit says.

A stop signal may reach a trainer after its last step: while it writes its results, ends
its attempt, or exits (a chaos loop, a node drain, torchrun passing on a SIGTERM). Its exit
code then says "preempted", and a restart would find nothing left to train. So the
supervisor gives each attempt an empty directory (``CKPT_LAUNCH_FINISHED``) and every rank
whose ``Checkpointer.end("finished")`` succeeded - the save in flight durable - leaves a
file there; when every rank of the job did, the attempt finished, and a preempted exit
after it is no reason to restart.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

ENV = "CKPT_LAUNCH_FINISHED"


def note_finished(*, rank: int, world_size: int) -> None:
    """Tell the supervisor, if any, that this rank finished its training. Under torchrun the
    supervisor of a node sees that node's ranks only: they are counted by their local rank
    (a rank that finished finished the job's training, which its ranks train in step)."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    with contextlib.suppress(OSError):  # a supervisor's folder gone: it cannot be told
        (Path(folder) / f"rank-{rank}-of-{world_size}").touch()


def notes_folder(attempt: int) -> Path:
    """A new empty folder for the notes of an attempt's ranks."""
    return Path(tempfile.mkdtemp(prefix=f"ckpt-launch-{attempt}-"))


def all_finished(folder: Path) -> bool:
    """Whether every rank of the attempt noted that it finished; the folder is removed."""
    try:
        names = [path.name for path in folder.iterdir()]
    except OSError:
        return False
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    notes = {tuple(name.split("-")[1::2]) for name in names if name.startswith("rank-")}
    worlds = {int(world) for _, world in notes}
    return len(worlds) == 1 and len(notes) == worlds.pop()
