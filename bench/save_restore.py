"""Two-phase save, dedup and verified restore of a ~1 GB state, against baselines measured
in the same run (these machines are noisy: read the ratios, not the seconds).

    .venv/bin/python bench/save_restore.py [--stores dir,s3] [--repeat 3] [--s3-repeat 2]

The state is 8 x nn.Linear(3264, 3264) plus Adam after one step (85.23M parameters,
48 tensors, 1.02 GB). For each store (``dir``: a directory on local disk; ``s3``: a
``moto_server`` started here on 127.0.0.1, or ``--s3-endpoint``) it measures:

- stall: how long ``save()`` holds training up with overlap off (the whole staging copy;
  ``bench/overlap.py`` measures overlapped staging), vs ``copy_`` of the same tensors into
  warm, preallocated buffers (the floor). Each save follows a change to every tensor, so every
  byte is staged, hashed and stored again.
- persist: bundle bytes / (end of staging → committed), vs the same bytes written raw right
  after each save: one file + fsync (dir) or one boto3 multipart ``upload_fileobj`` (s3).
- restore: ``resume()`` into a fresh model and optimizer (download, SHA-256 of every blob,
  load) vs downloading the same blobs raw right after each restore, with as many threads,
  into fresh memory kept until the last blob lands (a restore keeps what it reads); and,
  beside it, the same raw download hashing each blob (the floor of a verified restore).
- beside them: ``torch.save`` + fsync (dir) / ``torch.save`` to BytesIO + ``upload_fileobj``
  (s3), and ``torch.distributed.checkpoint.async_save`` to a local directory: their stall
  and time to durable.
- dedup: the same model with its base frozen and a rank-16 adapter per layer trained with
  Adam: bytes the second bundle uploads / its payload, vs the fraction that changed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.catalog.manifests import latest_manifest
from agent.format.payload import tensor_bytes
from ckpt import Checkpointer
from ckpt.core.storage import ObjectStore, keys, open_store
from ckpt.core.threads import IO_THREADS

GB = 1e9


@dataclass
class Row:
    figure: str
    store: str
    ours: str
    baseline: str
    ratio: float | None
    target: str
    note: str = ""


def build(
    width: int, layers: int, *, adapter_rank: int = 0, stepped: bool = True
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and Adam after one step (``stepped``; else Adam has no state yet, as in a
    process that is about to resume); with ``adapter_rank``, a frozen base plus adapters."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks.append(nn.Linear(width, width, bias=False))
        if adapter_rank:
            blocks.append(nn.Linear(width, adapter_rank, bias=False))
            blocks.append(nn.Linear(adapter_rank, width, bias=False))
    model = nn.Sequential(*blocks)
    if adapter_rank:
        for index, block in enumerate(blocks):
            block.weight.requires_grad_(index % 3 != 0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-3)
    if stepped:
        train_step(optimizer)
    return model, optimizer


def train_step(optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step with random gradients: every trainable tensor changes (and no
    two hold the same bytes, which would be stored once)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.randn_like(param)
    optimizer.step()


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return tensors


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def seconds(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


# -- baselines ------------------------------------------------------------------------------


def copy_floor(tensors: list[torch.Tensor], repeat: int) -> float:
    """``copy_`` into preallocated buffers that an earlier copy already touched."""
    buffers = [torch.empty_like(t) for t in tensors]
    for buffer, tensor in zip(buffers, tensors, strict=True):
        buffer.copy_(tensor)

    def copy() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)

    return median([seconds(copy) for _ in range(repeat)])


def raw_file_write(tensors: list[torch.Tensor], directory: Path) -> float:
    """The same bytes written to one new file and fsynced."""
    path = directory / f"raw-{uuid.uuid4().hex}"

    def write() -> None:
        with path.open("wb") as out:
            for tensor in tensors:
                out.write(tensor_bytes(tensor.contiguous()))
            out.flush()
            os.fsync(out.fileno())

    try:
        return seconds(write)
    finally:
        path.unlink()


class _Views(io.RawIOBase):
    """A read-only stream over tensor bytes, for ``upload_fileobj``."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._views = [tensor_bytes(t.contiguous()) for t in tensors]
        self._index = 0
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(target) and self._index < len(self._views):
            view = self._views[self._index][self._offset :]
            count = min(len(view), len(target) - filled)
            target[filled : filled + count] = view[:count]
            filled += count
            self._offset += count
            if self._offset == len(self._views[self._index]):
                self._index, self._offset = self._index + 1, 0
        return filled


def raw_s3_upload(client: Any, bucket: str, tensors: list[torch.Tensor]) -> float:
    """The same bytes as one boto3 multipart upload (64 MiB parts, 8 threads)."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(
        multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8
    )
    key = f"raw/{uuid.uuid4().hex}"
    try:
        return seconds(
            lambda: client.upload_fileobj(
                io.BufferedReader(_Views(tensors), 8 << 20), bucket, key, Config=config
            )
        )
    finally:
        client.delete_object(Bucket=bucket, Key=key)


Read = Callable[[str, int], memoryview]


def raw_download(read: Read, blobs: list[tuple[str, int]], *, sha256: bool = False) -> float:
    """Every blob, on as many threads as a restore uses, into fresh memory that is kept
    until the last arrives (as a restore keeps the state it reads), unverified; or each
    hashed as it lands (``sha256``: the floor of a verified restore)."""

    def fetch(blob: tuple[str, int]) -> memoryview:
        buffer = read(*blob)
        if sha256:
            hashlib.sha256(buffer).hexdigest()
        return buffer

    def download() -> None:
        with ThreadPoolExecutor(IO_THREADS) as pool:
            kept = list(pool.map(fetch, blobs))
        del kept

    return seconds(download)


def read_file(root: Path) -> Read:
    def read(key: str, size: int) -> memoryview:
        buffer = torch.empty(size, dtype=torch.uint8).numpy().data
        with (root / key).open("rb", buffering=0) as source:
            source.readinto(buffer)
        return buffer

    return read


def read_s3(client: Any, bucket: str, prefix: str) -> Read:
    def read(key: str, size: int) -> memoryview:
        body = client.get_object(Bucket=bucket, Key=prefix + key)["Body"]
        buffer = torch.empty(size, dtype=torch.uint8).numpy().data
        filled = 0
        while chunk := body.read(8 << 20):
            buffer[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return buffer

    return read


def dcp_async(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> tuple[float, float]:
    """``torch.distributed.checkpoint.async_save``: (stall, time to durable)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    target = directory / f"dcp-{uuid.uuid4().hex}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        started = time.perf_counter()
        future = dcp.async_save(
            {"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=target
        )
        stall = time.perf_counter() - started
        future.result()
        durable = time.perf_counter() - started
    shutil.rmtree(target)
    return stall, durable


# -- ckpt ----------------------------------------------------------------------------------


@dataclass
class Measured:
    """ckpt's figures, each beside its baseline measured right after it (medians)."""

    cold_stall: float
    stall: float
    persist: float
    raw_write: float
    payload: int
    restore: float
    raw_read: float
    raw_read_sha256: float


def measure_ckpt(
    store: ObjectStore,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    args: Any,
    repeat: int,
    raw_write: Callable[[], float],
    read: Read,
) -> Measured:
    """Saves and restores, each followed by its raw baseline on the same bytes: the disk's
    and the VM's speed drift by 2x and more within minutes, so a baseline measured apart
    from what it is compared with says little."""
    run = f"bench-{uuid.uuid4().hex[:8]}"
    stalls, persists, writes = [], [], []
    # Overlap off: the stall is the whole staging copy here (bench/overlap.py measures it on).
    with Checkpointer(
        run=run, store=store, models=model, optimizers=optimizer, overlap=False
    ) as ckpt:
        cold = ckpt.save()
        cold.wait()
        for _ in range(repeat):
            train_step(optimizer)  # every tensor changes: nothing is deduplicated
            ckpt.counters.step += 1  # a save at the position already durable saves nothing
            pending = ckpt.save()
            result = pending.wait()
            assert result.new_bytes > 0.99 * result.payload_bytes, result
            stalls.append(pending.stall_seconds)
            persists.append(result.persist_seconds)
            writes.append(raw_write())
        payload = result.payload_bytes
    manifest = latest_manifest(store, run)
    assert manifest is not None
    blobs = sorted(
        {
            (keys.blob_key(blob.sha256), blob.size)
            for rank in manifest.ranks
            for layer in rank.layers.values()
            for blob in layer.blobs
        }
    )
    restores, reads, hashed_reads = [], [], []
    for _ in range(repeat):
        fresh_model, fresh_optimizer = build(args.width, args.layers, stepped=False)
        with Checkpointer(
            run=run, store=store, models=fresh_model, optimizers=fresh_optimizer
        ) as again:
            restores.append(seconds(again.resume))
        for mine, theirs in zip(
            state_tensors(fresh_model, fresh_optimizer),
            state_tensors(model, optimizer),
            strict=True,
        ):
            assert torch.equal(mine, theirs)
        del fresh_model, fresh_optimizer
        reads.append(raw_download(read, blobs))
        hashed_reads.append(raw_download(read, blobs, sha256=True))
    return Measured(
        cold_stall=cold.stall_seconds,
        stall=median(stalls),
        persist=median(persists),
        raw_write=median(writes),
        payload=payload,
        restore=median(restores),
        raw_read=median(reads),
        raw_read_sha256=median(hashed_reads),
    )


def measure_dedup(store: ObjectStore, args: Any) -> tuple[float, float, float, float]:
    """(uploaded fraction of bundle 2, changed fraction, its stall, copy_ floor of its state)."""
    model, optimizer = build(args.width, args.layers, adapter_rank=16)
    changed = [p for p in model.parameters() if p.requires_grad]
    changed += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    with Checkpointer(
        run=f"lora-{uuid.uuid4().hex[:8]}", store=store, models=model, optimizers=optimizer
    ) as ckpt:
        ckpt.save().wait()
        train_step(optimizer)
        ckpt.counters.step += 1
        pending = ckpt.save()
        second = pending.wait()
    floor = copy_floor(state_tensors(model, optimizer), args.repeat)
    return (
        second.new_bytes / second.payload_bytes,
        nbytes(changed) / second.payload_bytes,
        pending.stall_seconds,
        floor,
    )


# -- the stores ----------------------------------------------------------------------------


@contextmanager
def s3_endpoint(args: Any, work: Path) -> Iterator[str]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    if args.s3_endpoint:
        yield args.s3_endpoint
        return
    from tests.s3_server import moto_server

    with moto_server(work / "moto.log") as server:
        yield server.endpoint


def bench_store(kind: str, args: Any, work: Path, rows: list[Row], tensors_of: Any) -> None:
    model, optimizer = tensors_of
    tensors = state_tensors(model, optimizer)
    repeat = args.repeat if kind == "dir" else args.s3_repeat
    floor = copy_floor(tensors, args.repeat)
    if kind == "dir":
        root = work / "store"
        store = open_store(str(root))
        measured = measure_ckpt(
            store,
            model,
            optimizer,
            args=args,
            repeat=repeat,
            raw_write=lambda: raw_file_write(tensors, work),
            read=read_file(root),
        )
        naive = median(
            [seconds(lambda: torch_save_file(model, optimizer, work)) for _ in range(repeat)]
        )
        write_name, naive_name = "one file + fsync", "torch.save + fsync"
    else:
        with s3_endpoint(args, work) as endpoint:
            os.environ["CKPT_S3_ENDPOINT"] = endpoint
            from ckpt.core.storage.s3 import S3ObjectStore

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            store = S3ObjectStore(f"s3://{bucket}/ckpt", endpoint_url=endpoint)
            client = store._client
            client.create_bucket(Bucket=bucket)
            measured = measure_ckpt(
                store,
                model,
                optimizer,
                args=args,
                repeat=repeat,
                raw_write=lambda: raw_s3_upload(client, bucket, tensors),
                read=read_s3(client, bucket, store.prefix),
            )
            naive = median(
                [seconds(lambda: torch_save_s3(model, optimizer, client, bucket)) for _ in range(1)]
            )
            write_name, naive_name = "boto3 multipart upload", "torch.save→BytesIO+upload_fileobj"
    raw_write, raw_read = measured.raw_write, measured.raw_read
    size = measured.payload
    rows += [
        Row(
            "stall per save",
            kind,
            f"{measured.stall * 1e3:.0f} ms",
            f"copy_ warm {floor * 1e3:.0f} ms",
            measured.stall / floor,
            "≤ 1.2",
            f"first save {measured.cold_stall:.2f} s (allocates)",
        ),
        Row(
            "persist",
            kind,
            f"{size / measured.persist / GB:.2f} GB/s",
            f"{write_name} {size / raw_write / GB:.2f} GB/s",
            (size / measured.persist) / (size / raw_write),
            "≥ 0.9",
            "SHA-256, a file per blob" if kind == "dir" else "the moto server",
        ),
        Row(
            "restore",
            kind,
            f"{measured.restore:.2f} s",
            f"raw parallel download {raw_read:.2f} s",
            measured.restore / raw_read,
            "≤ 1.2",
            f"raw + SHA-256 {measured.raw_read_sha256:.2f} s "
            f"({measured.restore / measured.raw_read_sha256:.2f})",
        ),
        Row(
            "naive save",
            kind,
            f"stall {measured.stall:.2f} s, durable {measured.stall + measured.persist:.2f} s",
            f"{naive_name}: stall = durable {naive:.2f} s",
            measured.stall / naive,
            "",
            "",
        ),
    ]


def torch_save_file(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    path = directory / "torch.pt"
    with path.open("wb") as out:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out)
        out.flush()
        os.fsync(out.fileno())
    path.unlink()


def torch_save_s3(
    model: nn.Module, optimizer: torch.optim.Optimizer, client: Any, bucket: str
) -> None:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    client.upload_fileobj(buffer, bucket, "naive.pt")
    client.delete_object(Bucket=bucket, Key="naive.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3264)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--s3-repeat", type=int, default=2)
    parser.add_argument("--stores", default="dir,s3")
    parser.add_argument("--s3-endpoint", default=None, help="default: start moto_server")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    os.environ.setdefault("CKPT_QUIET", "1")  # the table, not a line per save

    model, optimizer = build(args.width, args.layers)
    tensors = state_tensors(model, optimizer)
    print(
        f"state: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters + Adam, "
        f"{len(tensors)} tensors, {nbytes(tensors) / GB:.3f} GB; {os.cpu_count()} CPUs; "
        f"medians of {args.repeat} (s3: {args.s3_repeat})",
        flush=True,
    )
    rows: list[Row] = []
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-"))
    try:
        for kind in args.stores.split(","):
            bench_store(kind, args, work, rows, (model, optimizer))
            print(f"{kind}: done", flush=True)
        dcp = [dcp_async(model, optimizer, work) for _ in range(args.repeat)]
        stall_dcp, durable_dcp = median([s for s, _ in dcp]), median([d for _, d in dcp])
        rows.append(
            Row(
                "DCP async_save",
                "dir",
                "",
                f"stall {stall_dcp:.3f} s, durable {durable_dcp:.2f} s",
                None,
                "",
                "local directory",
            )
        )
        uploaded, changed, lora_stall, lora_floor = measure_dedup(
            open_store(str(work / "lora")), args
        )
        rows.append(
            Row(
                "dedup (frozen base)",
                "dir",
                f"uploaded {uploaded:.4f}",
                f"changed {changed:.4f}",
                uploaded - changed,
                "≤ +0.01",
                f"stall {lora_stall * 1e3:.0f} ms vs copy_ of all {lora_floor * 1e3:.0f} ms",
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows)


def print_table(rows: list[Row]) -> None:
    header = ("figure", "store", "ckpt", "baseline (same run)", "ratio", "target", "note")
    cells = [header] + [
        (
            r.figure,
            r.store,
            r.ours,
            r.baseline,
            ""
            if r.ratio is None
            else f"{r.ratio:.3f}"
            if r.figure.startswith("dedup")
            else f"{r.ratio:.2f}",
            r.target,
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
