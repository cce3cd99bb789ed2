"""Where a verified restore's time goes: ``resume()`` beside raw reads of the same blobs.

    .venv/bin/python bench/restore_floor.py [--repeat 5] [--width 3264] [--layers 8] [--cold]

One bundle of the ``bench/save_restore.py`` state (8 x nn.Linear(3264, 3264) + Adam, 1.02 GB)
is saved to a directory store. Then each of these runs in a process of its own, as a
replacement pod's restore does, in a rotating order, ``--repeat`` times (medians):

- ``resume()`` into a fresh model and optimizer, built before the clock starts: it reads
  every blob (into the model's parameters, and new memory for Adam's state), checks its
  SHA-256 and loads it;
- the same blobs read raw on as many threads into new memory, kept until the last lands:
  unverified, hashing each with SHA-256 (what a restore verifies), and with BLAKE3 when the
  ``blake3`` package is installed (a faster cryptographic hash, for comparison).

``--cold`` drops the blobs' pages from the page cache before each measurement
(``posix_fadvise(DONTNEED)``, untimed), as a replacement pod on another node finds them: the
reads then wait on the disk, and hashing overlaps the wait. Without it the blobs are in the
page cache (just written), the fastest a read can be.

A process of its own for each: in one long process, memory freed by one measurement and
touched again by the next costs what the host took back in between (a first touch runs at
~1 GB/s on these VMs, MACHINE-LIMITS), so the order decided the figures. Each is printed
with its wall time and its CPU time: with few cores a verified read is bound by CPU (read
plus hash), not by the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from save_restore import build  # the same state as the main benchmark

from agent.catalog.manifests import latest_manifest
from ckpt import Checkpointer
from ckpt.core.storage import keys, open_store
from ckpt.core.threads import IO_THREADS

Hash = Callable[[memoryview], object]
Timing = tuple[float, float]  # wall seconds, CPU seconds of this process


def timed(action: Callable[[], object]) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def hashes() -> dict[str, Hash | None]:
    found: dict[str, Hash | None] = {"raw": None, "raw + SHA-256": hashlib.sha256}
    try:
        import blake3  # type: ignore[import-not-found]
    except ImportError:
        return found
    found["raw + BLAKE3"] = blake3.blake3
    return found


def raw_read(root: Path, blobs: list[tuple[str, int]], digest: Hash | None) -> None:
    """Every blob into fresh memory on ``IO_THREADS`` threads, hashed as it lands."""
    import torch

    def fetch(blob: tuple[str, int]) -> memoryview:
        key, size = blob
        buffer = torch.empty(size, dtype=torch.uint8).numpy().data
        with (root / key).open("rb", buffering=0) as source:
            source.readinto(buffer)
        if digest is not None:
            digest(buffer)
        return buffer

    with ThreadPoolExecutor(IO_THREADS) as pool:
        kept = list(pool.map(fetch, blobs))
    del kept


RESUME = "resume() (SHA-256 of every blob)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3264)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--cold", action="store_true", help="drop the blobs' cached pages first")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one child's task
    args = parser.parse_args()
    os.environ.setdefault("CKPT_QUIET", "1")
    if args.measure is not None:
        wall, cpu = measure(args, Path(args.dir), args.measure)
        print(json.dumps([wall, cpu]))
        return
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-restore-floor-"))
    try:
        compare(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def blobs_of(work: Path) -> list[tuple[str, int]]:
    manifest = latest_manifest(open_store(str(work)), "floor")
    assert manifest is not None
    return sorted(
        {
            (keys.blob_key(blob.sha256), blob.size)
            for rank in manifest.ranks
            for layer in rank.layers.values()
            for blob in layer.blobs
        }
    )


def drop_cached(root: Path, blobs: list[tuple[str, int]]) -> None:
    """Evict the blobs' pages from the page cache (they are clean: the save fsynced them)."""
    for key, _ in blobs:
        descriptor = os.open(root / key, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def measure(args: argparse.Namespace, work: Path, name: str) -> Timing:
    """One measurement, in this (fresh) process."""
    if args.cold:
        drop_cached(work, blobs_of(work))
    if name != RESUME:
        blobs, digest = blobs_of(work), hashes()[name]
        return timed(lambda: raw_read(work, blobs, digest))
    model, optimizer = build(args.width, args.layers, stepped=False)
    store = open_store(str(work))
    with Checkpointer(run="floor", store=store, models=model, optimizers=optimizer) as ckpt:
        return timed(ckpt.resume)


def compare(args: argparse.Namespace, work: Path) -> None:
    model, optimizer = build(args.width, args.layers)
    store = open_store(str(work))
    with Checkpointer(run="floor", store=store, models=model, optimizers=optimizer) as ckpt:
        ckpt.save().wait()
    del model, optimizer
    blobs = blobs_of(work)
    names = [RESUME, *hashes()]
    print(
        f"{len(blobs)} blobs, {sum(size for _, size in blobs) / 1e9:.3f} GB; "
        f"{os.cpu_count()} CPUs, {IO_THREADS} I/O threads; each in a process of its own, "
        f"medians of {args.repeat}; page cache {'dropped' if args.cold else 'warm'}",
        flush=True,
    )
    timings: dict[str, list[Timing]] = {name: [] for name in names}
    child = [sys.executable, __file__, "--width", str(args.width), "--layers", str(args.layers)]
    child += ["--cold"] if args.cold else []
    for index in range(args.repeat):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            done = subprocess.run(
                [*child, "--dir", str(work), "--measure", name],
                capture_output=True,
                text=True,
                check=True,
            )
            wall, cpu = json.loads(done.stdout.strip().splitlines()[-1])
            timings[name].append((wall, cpu))
    raw = statistics.median(wall for wall, _ in timings["raw"])
    print(f"{'':36} {'wall':>8} {'÷ raw':>6} {'CPU':>8}")
    for name, measured in timings.items():
        wall = statistics.median(w for w, _ in measured)
        cpu = statistics.median(c for _, c in measured)
        print(f"{name:36} {wall:7.3f}s {wall / raw:6.2f} {cpu:7.3f}s")
    if "raw + BLAKE3" not in timings:
        print("(no BLAKE3 row: pip install blake3)")


if __name__ == "__main__":
    main()
