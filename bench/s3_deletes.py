"""What garbage collection's deletes cost on S3: one request per key against one
``DeleteObjects`` per 1,000 keys (``S3ObjectStore.delete_many``), on a ``moto_server`` it
starts on 127.0.0.1 (or ``--s3-endpoint URL`` with credentials in the environment).

    .venv/bin/python bench/s3_deletes.py [--objects 2000] [--repeat 3]

Each repeat puts ``--objects`` small objects (as manifests are) and deletes them one way,
then puts them again and deletes them the other way; the medians and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt.core.storage.s3 import S3ObjectStore
from tests.s3_server import S3Server, aws_environment, moto_server


@contextlib.contextmanager
def endpoint(url: str | None) -> Iterator[tuple[str, str]]:
    """An endpoint and a fresh bucket on it."""
    if url is not None:
        bucket = f"ckpt-bench-{int(time.time())}"
        S3Server(url).client().create_bucket(Bucket=bucket)
        yield url, bucket
        return
    with (
        tempfile.TemporaryDirectory() as tmp,
        aws_environment(),
        moto_server(Path(tmp) / "moto.log") as server,
    ):
        yield server.endpoint, server.bucket()


def timed(store: S3ObjectStore, keys: list[str], delete: Callable[[list[str]], None]) -> float:
    with ThreadPoolExecutor(8) as pool:  # the puts are not what is measured
        list(pool.map(lambda key: store.put(key, [b"{}"]), keys))
    started = time.perf_counter()
    delete(keys)
    elapsed = time.perf_counter() - started
    assert not list(store.list_keys("runs/")), "objects left behind"
    return elapsed


def one_at_a_time(store: S3ObjectStore, keys: list[str]) -> None:
    for key in keys:
        store.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--s3-endpoint", default=None)
    args = parser.parse_args()
    with endpoint(args.s3_endpoint) as (url, bucket):
        store = S3ObjectStore(f"s3://{bucket}/bench", endpoint_url=url)
        keys = [f"runs/r/bundles/{i:012}/manifest.json" for i in range(args.objects)]
        one_by_one: list[float] = []
        batched: list[float] = []
        for _ in range(args.repeat):  # interleaved: the machine's drift falls on both
            one_by_one.append(timed(store, keys, functools.partial(one_at_a_time, store)))
            batched.append(timed(store, keys, store.delete_many))
    slow, fast = statistics.median(one_by_one), statistics.median(batched)
    print(f"deleting {args.objects} objects, medians of {args.repeat}:")
    print(
        f"  one DeleteObject per key:           {slow:7.2f} s ({slow / args.objects * 1e3:.2f} ms a key)"
    )
    print(
        f"  DeleteObjects, 1,000 keys a request: {fast:7.2f} s ({fast / args.objects * 1e3:.3f} ms a key)"
    )
    print(f"  ratio: {slow / fast:.1f}x")


if __name__ == "__main__":
    main()
