"""``ckpt launch`` does not restart a trainer that finished training, however it exits:
a stop signal that lands after the last step (while the trainer writes its results or
exits) is no preemption of anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.launch.finished import ENV, all_finished, note_finished

CKPT = str(Path(sys.executable).parent / "ckpt")

# Trains to step 4, ends the attempt as finished and closes (the default SIGTERM handler is
# back), then says so and waits: the test's SIGTERM kills it there. A restart would run it
# again, resume at step 4 with nothing to train, and exit 0.
FINISHED_TRAINER = """
import os, signal, sys
from pathlib import Path

import torch
from torch import nn

from ckpt import Checkpointer

store, done = sys.argv[1], Path(sys.argv[2])
model = nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
checkpointer = Checkpointer(
    run="finished", store=store, models={"model": model}, optimizers={"optimizer": optimizer}
)
checkpointer.resume()
while checkpointer.counters.step < 4:
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    checkpointer.counters.step += 1
    checkpointer.maybe_save()
checkpointer.save().wait()
checkpointer.end("finished")
checkpointer.close()
if os.environ["CKPT_LAUNCH_ATTEMPT"] == "1":
    done.write_text(str(os.getpid()))
    while True:
        signal.pause()
"""


def wait_for(path: Path, process: subprocess.Popen[bytes], *, seconds: float = 120) -> str:
    """The text of ``path`` once it appears (the trainer wrote it), while ``process`` runs."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, "ckpt launch ended before the trainer finished"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)  # polling for the file, not timing the trainer
    return path.read_text()


@pytest.mark.slow
def test_a_sigterm_after_the_trainer_finished_restarts_nothing(tmp_path: Path) -> None:
    script, done, log = tmp_path / "trainer.py", tmp_path / "done", tmp_path / "launch.log"
    script.write_text(FINISHED_TRAINER)
    command = [CKPT, "launch", "--backoff", "0", "--", sys.executable, str(script)]
    with log.open("w") as stderr:
        launch = subprocess.Popen(
            [*command, str(tmp_path / "store"), str(done)],
            stderr=stderr,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        try:
            os.kill(int(wait_for(done, launch)), signal.SIGTERM)
            code = launch.wait(timeout=120)
        finally:
            launch.kill()
    text = log.read_text()
    assert code == 0, text
    assert "attempt 2" not in text, text
    assert "killed by SIGTERM, after the trainer finished its training; exiting with 0" in text


def test_an_attempt_finished_when_every_rank_noted_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def notes(*ranks: int, world_size: int) -> Path:
        folder = tmp_path / f"notes-{world_size}-{len(ranks)}"
        folder.mkdir()
        monkeypatch.setenv(ENV, str(folder))
        for rank in ranks:
            note_finished(rank=rank, world_size=world_size)
        return folder

    assert all_finished(notes(0, world_size=1))
    assert all_finished(notes(0, 1, world_size=2))
    assert not all_finished(notes(1, world_size=2))  # rank 0 was stopped before its end
    assert not all_finished(notes(world_size=2))
    assert not all_finished(tmp_path / "absent")
    # Two nodes of two ranks: a node's supervisor counts the ranks it runs, by local rank.
    for rank in (2, 3):
        monkeypatch.setenv("LOCAL_RANK", str(rank - 2))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        if rank == 2:
            folder = notes(world_size=4)
        note_finished(rank=rank, world_size=4)
    assert all_finished(folder)
