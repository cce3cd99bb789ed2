"""The save tax: what a save costs the training loop, until it is durable, against baselines
measured in the same run (these machines are noisy: read the ratios, not the seconds).

    .venv/bin/python bench/save_tax.py [--repeat 3] [--width 3264] [--layers 8]

The state is ``--layers`` x nn.Linear(width, width) plus Adam (the defaults: 1.02 GB, as in
``save_restore.py``), saved to a local directory. Two loops:

- ``cpu``: forward + backward of a batch and Adam's step, on every core (CPU training);
- ``sleep``: ``time.sleep`` standing in for a GPU's forward and backward, then Adam's step
  on one thread: the loop's compute leaves a core free (a stand-in, not a GPU).

For each loop and each way of saving (ckpt as it ships, with overlap off, at niceness 10,
and with its pause during the optimizer's steps flipped: off by default in the cpu loop,
on in the sleep loop as it is once a process uses CUDA; ``torch.distributed.checkpoint.
async_save``; ``torch.save`` + fsync; and three floors, a ``copy_`` then one thread that
writes one file through the page cache and fsyncs it, writes it with ``O_DIRECT``, or
only hashes the bytes), in rotating order within each round:
a few plain iterations (their median is one iteration's time), then a save, then iterations
until the save is durable. The *tax* is the wall time from the save's call to the end of the
first iteration that ends after it is durable, less that many plain iterations. Beside it:
the stall (time the loop spent inside the save call, and for ckpt the next step's wait), the
time to durable, ckpt's own ``SaveResult.tax_seconds``, and the peak extra RSS (VmHWM over
the RSS before the checkpointer existed, so a method's buffers count; a row without a save
shows what the loop's own iterations add). The baseline is a ``copy_`` of the state into
warm buffers, measured in each round.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import Checkpointer
from ckpt.core.storage import open_store

GB = 1e9
DIRECT_CHUNK = 64 << 20  # bytes per O_DIRECT write
PLAIN = 4  # plain iterations before each save (the first is not counted)
METHODS = (
    "none",
    "ckpt",
    "ckpt overlap off",
    "ckpt niceness 10",
    "ckpt yield flipped",
    "DCP async_save",
    "torch.save + fsync",
    "copy_ + write + fsync",
    "copy_ + O_DIRECT write",
    "copy_ + SHA-256",
)
# What the three floors do on their thread after the copy_ (``_unchecked``).
FLOORS = {
    "copy_ + write + fsync": "page cache",
    "copy_ + O_DIRECT write": "direct",
    "copy_ + SHA-256": "hash",
}


@dataclass
class Loop:
    """A training loop over one model and its Adam."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: torch.Tensor | None  # cpu: forward + backward of it; sleep: None
    sleep: float
    threads: int

    def iteration(self) -> float:
        """One iteration; when it ended."""
        torch.set_num_threads(self.threads)
        if self.batch is not None:
            self.model(self.batch).square().mean().backward()
        else:
            time.sleep(self.sleep)
        self.optimizer.step()
        return time.perf_counter()

    def tensors(self) -> list[torch.Tensor]:
        state = list(self.model.state_dict().values())
        return state + [
            v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ]


@dataclass
class Trial:
    tax: float
    stall: float
    durable: float
    peak: int
    own_tax: float | None = None


@dataclass
class Figures:
    trials: list[Trial] = field(default_factory=list)

    def median(self, pick: Callable[[Trial], float | None]) -> float | None:
        values = [v for t in self.trials if (v := pick(t)) is not None]
        return statistics.median(values) if values else None


def _status(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name):
                return int(line.split()[1]) * 1024
    raise LookupError(field_name)


def reset_peak() -> int:
    """Reset VmHWM to the RSS now (Linux ``clear_refs``); the RSS now."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS:")


# A save started: the time its call took, whether it is durable now, and once it is, the
# stall and the tax the saver itself reports (ckpt's SaveResult; None for the others).
Started = tuple[float, Callable[[], bool], Callable[[], tuple[float, float | None]]]


@contextmanager
def saver(method: str, loop: Loop, work: Path) -> Iterator[Callable[[int], Started] | None]:
    """A way of saving, set up (with one save made, untimed, so its buffers are warm)."""
    target = work / uuid.uuid4().hex
    if method == "none":
        yield None
    elif method.startswith("ckpt"):
        if method == "ckpt niceness 10":  # the background threads below training's priority
            os.environ["CKPT_SAVE_NICENESS"] = "10"
        # Pauses in the optimizer's steps: the agent's default is on once CUDA is in use, off
        # on the CPU alone; the sleep loop stands in for a GPU, so it is set on for it.
        on = loop.batch is None
        if method == "ckpt yield flipped":
            on = not on
        os.environ["CKPT_SAVE_YIELD_SECONDS"] = "1" if on else "0"
        with Checkpointer(
            run="tax",
            store=open_store(str(target)),
            models=loop.model,
            optimizers=loop.optimizer,
            overlap=method != "ckpt overlap off",
        ) as ckpt:

            def save(step: int) -> Started:
                ckpt.counters.step = step
                pending = ckpt.save()

                def finish() -> tuple[float, float | None]:
                    result = pending.wait()
                    return result.stall_seconds, result.tax_seconds

                return pending.stall_seconds, pending.done, finish

            os.environ.pop("CKPT_SAVE_NICENESS", None)
            os.environ.pop("CKPT_SAVE_YIELD_SECONDS", None)
            save(1)[2]()
            yield save
            ckpt.release_staging()
    elif method == "DCP async_save":
        import torch.distributed.checkpoint as dcp

        def save(step: int) -> Started:
            state = {"model": loop.model.state_dict(), "optim": loop.optimizer.state_dict()}
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming ... a single process"
                future = dcp.async_save(state, checkpoint_id=target / str(step))
            stall = time.perf_counter() - started

            def finish() -> tuple[float, float | None]:
                future.result()
                return stall, None

            return stall, future.done, finish

        save(1)[2]()
        yield save
    elif method in FLOORS:
        yield from _unchecked(loop, target, FLOORS[method])
    else:

        def save(step: int) -> Started:
            started = time.perf_counter()
            target.mkdir(parents=True, exist_ok=True)
            state = {"model": loop.model.state_dict(), "optim": loop.optimizer.state_dict()}
            with (target / f"{step}.pt").open("wb") as out:
                torch.save(state, out)
                out.flush()
                os.fsync(out.fileno())
            stall = time.perf_counter() - started
            return stall, lambda: True, lambda: (stall, None)

        save(1)
        yield save
    shutil.rmtree(target, ignore_errors=True)


def _unchecked(loop: Loop, target: Path, work: str) -> Iterator[Callable[[int], Started]]:
    """The floors under a save that checks its bytes: a ``copy_`` into warm buffers while
    the loop waits, then one thread that does one part of a save's work and no more:
    writes the buffers to one file through the page cache and fsyncs it (``page cache``:
    the least any asynchronous save that is durable does), writes them with ``O_DIRECT``
    (through one aligned buffer, which the disk reads by DMA: no copy into the page cache),
    or only hashes them (``hash``: SHA-256, as ckpt's blob keys; nothing written)."""
    buffers = [torch.empty_like(t) for t in loop.tensors()]
    aligned = mmap.mmap(-1, DIRECT_CHUNK) if work == "direct" else None  # page-aligned
    target.mkdir(parents=True)

    def bytes_of(buffer: torch.Tensor) -> memoryview:
        return buffer.reshape(-1).view(torch.uint8).numpy().data

    def write(path: Path) -> None:
        if work == "hash":
            for buffer in buffers:
                hashlib.sha256(bytes_of(buffer)).digest()
        elif aligned is not None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
            try:
                for buffer in buffers:
                    data = bytes_of(buffer)
                    for offset in range(0, len(data), DIRECT_CHUNK):
                        chunk = data[offset : offset + DIRECT_CHUNK]
                        aligned[: len(chunk)] = chunk  # the tail padded to whole pages
                        os.write(fd, memoryview(aligned)[: -(-len(chunk) // 4096) * 4096])
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            with path.open("wb") as out:
                for buffer in buffers:
                    out.write(bytes_of(buffer))
                out.flush()
                os.fsync(out.fileno())

    def save(step: int) -> Started:
        stall = copy_floor(loop.tensors(), buffers)
        writer = threading.Thread(target=write, args=(target / f"{step}.bin",))
        writer.start()

        def finish() -> tuple[float, float | None]:
            writer.join()
            return stall, None

        return stall, lambda: not writer.is_alive(), finish

    save(1)[2]()
    yield save


def trial(method: str, loop: Loop, work: Path, step: int) -> Trial:
    """Plain iterations, then a save and iterations until it is durable (see the doc)."""
    base = reset_peak()
    with saver(method, loop, work) as save:
        ends = [loop.iteration() for _ in range(PLAIN)]
        plain = statistics.median(b - a for a, b in itertools.pairwise(ends))
        started = ends[-1]
        if save is None:
            stall, done, finish = 0.0, (lambda: True), (lambda: (0.0, None))
        else:
            stall, done, finish = save(step)
        durable_at, count, end = None, 0, started
        while durable_at is None or end < durable_at:
            if durable_at is None and done():
                durable_at = time.perf_counter()
                continue
            end = loop.iteration()
            count += 1
        stall, own_tax = finish()
        peak = _status("VmHWM:") - base
    return Trial(end - started - count * plain, stall, durable_at - started, peak, own_tax)


def copy_floor(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> float:
    """One ``copy_`` of the state into warm buffers."""
    started = time.perf_counter()
    for buffer, tensor in zip(buffers, tensors, strict=True):
        buffer.copy_(tensor)
    return time.perf_counter() - started


def build(args: argparse.Namespace, kind: str) -> Loop:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, args.width)
    model(batch[:1]).square().mean().backward()
    optimizer.step()  # Adam's state exists; the gradients stay, so every step changes it
    cores = os.cpu_count() or 1
    if kind == "cpu":
        return Loop(model, optimizer, batch, 0.0, cores)
    return Loop(model, optimizer, None, args.sleep, 1)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def report(kind: str, figures: dict[str, Figures], floor: float, size: int) -> None:
    dcp = figures["DCP async_save"].median(lambda t: t.tax) or float("nan")
    print(f"\n{kind} loop; warm copy_ of the state {ms(floor)}")
    print(
        "| save | tax | tax / copy_ | tax / DCP's | ckpt's own tax | stall | durable | peak extra RSS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for method in METHODS:
        f = figures[method]
        label = method
        if method == "ckpt yield flipped":
            label = "ckpt yield off" if kind == "sleep" else "ckpt yield 1 s"
        tax = f.median(lambda t: t.tax) or 0.0
        peak = f.median(lambda t: t.peak) or 0.0
        print(
            f"| {label} | {ms(tax)} | {tax / floor:.2f} | {tax / dcp:.2f} | "
            f"{ms(f.median(lambda t: t.own_tax))} | {ms(f.median(lambda t: t.stall))} | "
            f"{ms(f.median(lambda t: t.durable))} | {peak / GB:.2f} GB ({peak / size:.2f}) |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3264)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sleep", type=float, default=0.5, help="the sleep loop's GPU stand-in")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--loops", default="cpu,sleep")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    os.environ.setdefault("CKPT_QUIET", "1")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-tax-"))
    try:
        for kind in args.loops.split(","):
            loop = build(args, kind)
            tensors = loop.tensors()
            size = sum(t.nbytes for t in tensors)
            buffers = [torch.empty_like(t) for t in tensors]
            copy_floor(tensors, buffers)
            print(
                f"state {size / GB:.2f} GB, {len(tensors)} tensors; {os.cpu_count()} CPUs; "
                f"medians of {args.repeat}, methods in rotating order",
                flush=True,
            )
            figures = {method: Figures() for method in METHODS}
            floors = []
            for round_ in range(args.repeat):
                shift = round_ % len(METHODS)
                for method in METHODS[shift:] + METHODS[:shift]:
                    done = trial(method, loop, work, 2 + round_)
                    figures[method].trials.append(done)
                    print(f"  {kind} {method}: {done}", file=sys.stderr, flush=True)
                    floors.append(copy_floor(tensors, buffers))
            report(kind, figures, statistics.median(floors), size)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
