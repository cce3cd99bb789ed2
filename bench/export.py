"""``ckpt export`` beside a raw copy of the same bytes: time, and peak memory.

    .venv/bin/python bench/export.py [--repeat 3] [--width 3264] [--layers 8]

One bundle of the ``bench/save_restore.py`` state (8 x nn.Linear(3264, 3264) + Adam after
a step, 1.02 GB) is saved to a directory store. Then each of these runs in a process of its
own, in a rotating order, ``--repeat`` times (medians), its output deleted after it:

- ``raw copy``: every blob of the bundle copied to a new folder on as many threads as the
  export reads with (``shutil.copyfile``: no hashing, no parsing), the floor for moving
  these bytes from the store to files;
- ``export safetensors`` and ``export dcp``: ``agent.interop.exporting.export`` of the whole
  state (weights and Adam's moments, 1.02 GB of tensors), every blob checked against its
  SHA-256 before its bytes are written.

Each prints its wall time, and the process's peak resident memory (``VmHWM``) with its
resident memory before the measured part began (the interpreter and torch): the peak ÷ the
bundle's bytes shows whether the export held a second copy of the state (it would be > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from save_restore import build  # the same state as the main benchmark

from agent.catalog.manifests import latest_manifest
from agent.interop.exporting import export
from ckpt import Checkpointer
from ckpt.core.storage import keys, open_store
from ckpt.core.threads import IO_THREADS

RAW = "raw copy"
NAMES = {RAW: None, "export safetensors": "safetensors", "export dcp": "dcp"}


def memory(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmHWM``: peak resident, ``VmRSS``: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def blobs_of(store: Path) -> list[str]:
    manifest = latest_manifest(open_store(str(store)), "export")
    assert manifest is not None
    return sorted(
        {
            keys.blob_key(blob.sha256)
            for rank in manifest.ranks
            for layer in rank.layers.values()
            for blob in layer.blobs
        }
    )


def measure(store: Path, name: str, out: Path) -> tuple[float, int, int]:
    """One measurement in this (fresh) process: wall seconds, resident bytes before, peak."""
    blobs = blobs_of(store)
    before = memory("VmRSS")
    start = time.perf_counter()
    if NAMES[name] is None:
        out.mkdir()

        def copy(key: str) -> None:
            shutil.copyfile(store / key, out / key.rsplit("/", 1)[1])

        with ThreadPoolExecutor(IO_THREADS) as pool:
            list(pool.map(copy, blobs))
    else:
        export(str(store), "export", str(out), to=NAMES[name], whole_state=True, quiet=True)
    wall = time.perf_counter() - start
    peak = memory("VmHWM")
    shutil.rmtree(out)
    return wall, before, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3264)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one child's task
    args = parser.parse_args()
    os.environ.setdefault("CKPT_QUIET", "1")
    if args.measure is not None:
        work = Path(args.dir)
        print(json.dumps(measure(work / "store", args.measure, work / "out")))
        return
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-export-bench-"))
    try:
        compare(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(args: argparse.Namespace, work: Path) -> None:
    model, optimizer = build(args.width, args.layers)
    store = open_store(str(work / "store"))
    with Checkpointer(run="export", store=store, models=model, optimizers=optimizer) as ckpt:
        ckpt.save().wait()
    del model, optimizer
    size = sum((work / "store" / key).stat().st_size for key in blobs_of(work / "store"))
    print(
        f"bundle: {size / 1e9:.3f} GB in {len(blobs_of(work / 'store'))} blobs; "
        f"{os.cpu_count()} CPUs, {IO_THREADS} I/O threads; each in a process of its own, "
        f"medians of {args.repeat}",
        flush=True,
    )
    names = list(NAMES)
    found: dict[str, list[tuple[float, int, int]]] = {name: [] for name in names}
    for index in range(args.repeat):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            done = subprocess.run(
                [sys.executable, __file__, "--dir", str(work), "--measure", name],
                capture_output=True,
                text=True,
                check=True,
            )
            wall, before, peak = json.loads(done.stdout.strip().splitlines()[-1])
            found[name].append((wall, before, peak))
    raw = statistics.median(wall for wall, _, _ in found[RAW])
    print(
        f"{'':20} {'wall':>8} {'÷ raw':>6} {'RSS before':>11} {'peak RSS':>9} {'peak ÷ bundle':>14}"
    )
    for name, measured in found.items():
        wall = statistics.median(w for w, _, _ in measured)
        before = statistics.median(b for _, b, _ in measured)
        peak = statistics.median(p for _, _, p in measured)
        print(
            f"{name:20} {wall:7.3f}s {wall / raw:6.2f} {before / 1e9:9.3f}GB "
            f"{peak / 1e9:7.3f}GB {peak / size:14.2f}"
        )


if __name__ == "__main__":
    main()
