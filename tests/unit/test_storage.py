"""The directory store (the reference ObjectStore), object keys, and open_store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.core.errors import StoreError
from ckpt.core.storage import DirectoryStore, ObjectStore, keys, open_store


@pytest.fixture
def store(tmp_path: Path) -> DirectoryStore:
    return DirectoryStore(tmp_path / "store")


def files_under(root: Path) -> list[str]:
    """Every file on disk, hidden ones included."""
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())


def test_directory_store_is_an_object_store(store: DirectoryStore) -> None:
    assert isinstance(store, ObjectStore)
    assert store.url.startswith("file:///")


def test_put_then_get_concatenates_the_pieces(store: DirectoryStore) -> None:
    array = bytearray(range(4))

    store.put("blobs/sha256/ab/abc", [b"head", memoryview(array), b"", memoryview(b"tail")[1:]])

    assert store.get("blobs/sha256/ab/abc") == b"head\x00\x01\x02\x03ail"
    assert store.size("blobs/sha256/ab/abc") == 11


def test_put_accepts_a_generator_and_replaces_the_old_object(store: DirectoryStore) -> None:
    store.put("k", [b"old object, longer"])

    store.put("k", (bytes([i]) for i in range(3)))

    assert store.get("k") == b"\x00\x01\x02"


def test_put_of_nothing_stores_an_empty_object(store: DirectoryStore) -> None:
    store.put("empty", [])

    assert store.get("empty") == b""
    assert store.size("empty") == 0


def test_absent_keys(store: DirectoryStore) -> None:
    with pytest.raises(StoreError, match="no object 'nope'"):
        store.get("nope")
    with pytest.raises(StoreError, match="no object"):
        store.read_into("nope", memoryview(bytearray(4)))
    assert store.size("nope") is None
    store.delete("nope")  # absent keys are ignored


def test_stat_gives_the_size_and_when_the_object_was_written(store: DirectoryStore) -> None:
    before = time.time()
    store.put("blobs/sha256/ab/abc", [b"12345"])
    found = store.stat("blobs/sha256/ab/abc")
    assert found is not None
    assert (found.key, found.size) == ("blobs/sha256/ab/abc", 5)
    # The filesystem's clock may round: allow what its timestamps are coarse by.
    assert before - 2 <= found.modified <= time.time() + 2
    assert store.stat("blobs/sha256/ab/nope") is None
    (store.root / "blobs" / "sha256" / "cd").write_text("a file where a directory goes")
    with pytest.raises(StoreError, match="cannot stat"):
        store.stat("blobs/sha256/cd/cdef")


def test_read_into_fills_the_start_of_the_buffer(store: DirectoryStore) -> None:
    store.put("k", [b"abcdef"])
    buffer = bytearray(b"." * 10)

    size = store.read_into("k", memoryview(buffer))

    assert size == 6
    assert buffer == bytearray(b"abcdef....")


def test_read_into_an_exact_buffer(store: DirectoryStore) -> None:
    store.put("k", [b"abcdef"])
    buffer = bytearray(6)

    assert store.read_into("k", memoryview(buffer)[0:6]) == 6
    assert buffer == b"abcdef"


def test_read_into_refuses_a_buffer_that_is_too_small(store: DirectoryStore) -> None:
    store.put("k", [b"abcdef"])
    buffer = bytearray(5)

    with pytest.raises(StoreError, match="6 bytes"):
        store.read_into("k", memoryview(buffer))


def test_list_keys_is_sorted_and_filtered_by_prefix(store: DirectoryStore) -> None:
    for key in [
        "runs/b/x",
        "blobs/sha256/ff/ff1",
        "runs/a/bundles/2",
        "runs/a/bundles/10",
        "runs/ab",
    ]:
        store.put(key, [b"1"])

    assert list(store.list_keys("")) == [
        "blobs/sha256/ff/ff1",
        "runs/a/bundles/10",
        "runs/a/bundles/2",
        "runs/ab",
        "runs/b/x",
    ]
    assert list(store.list_keys("runs/a")) == ["runs/a/bundles/10", "runs/a/bundles/2", "runs/ab"]
    assert list(store.list_keys("runs/a/")) == ["runs/a/bundles/10", "runs/a/bundles/2"]
    assert list(store.list_keys("nothing/")) == []


def test_list_keys_of_a_fresh_store_is_empty(store: DirectoryStore) -> None:
    assert list(store.list_keys("")) == []


def test_delete_removes_the_object(store: DirectoryStore) -> None:
    store.put("a/b", [b"1"])
    store.put("a/c", [b"2"])

    store.delete("a/b")

    assert store.size("a/b") is None
    assert list(store.list_keys("")) == ["a/c"]


def test_delete_many_removes_those_objects_and_ignores_absent_ones(store: DirectoryStore) -> None:
    for key in ["a/b/k1", "a/k2", "c/k3"]:
        store.put(key, [b"1"])

    store.delete_many(["a/b/k1", "c/k3", "c/missing"])
    store.delete_many([])

    assert list(store.list_keys("")) == ["a/k2"]
    assert directories_under(store.root) == ["a"]


def directories_under(root: Path) -> list[str]:
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_dir())


def test_delete_removes_the_directories_it_empties_up_to_the_root(store: DirectoryStore) -> None:
    for key in ["a/b/c/k1", "a/b/d/k2", "a/k3"]:
        store.put(key, [b"1"])

    store.delete("a/b/c/k1")
    assert directories_under(store.root) == ["a", "a/b", "a/b/d"]
    store.delete("a/b/d/k2")
    assert directories_under(store.root) == ["a"]
    store.delete("a/k3")
    assert directories_under(store.root) == []
    assert store.root.is_dir()  # the root stays
    store.put("a/b/k4", [b"2"])  # and takes new objects
    assert store.get("a/b/k4") == b"2"


def test_delete_of_an_absent_key_removes_nothing_else(store: DirectoryStore) -> None:
    store.put("a/k", [b"1"])

    store.delete("a/b/missing")
    store.delete("missing")

    assert directories_under(store.root) == ["a"]
    assert store.get("a/k") == b"1"


def test_concurrent_puts_deletes_and_listings_never_fail(store: DirectoryStore) -> None:
    """Each delete empties the shared directories that the other threads' puts are making
    again at that moment; every put must land and every listing must succeed."""
    rounds, writers = 300, 4
    start = threading.Barrier(writers + 1)
    failures: list[BaseException] = []
    done = threading.Event()

    def write(name: str) -> None:
        start.wait()
        try:
            for i in range(rounds):
                key = f"blobs/sha256/ab/{name}"
                store.put(key, [name.encode(), str(i).encode()])
                assert store.get(key) == f"{name}{i}".encode()
                store.delete(key)
        except BaseException as err:
            failures.append(err)

    def list_all() -> None:
        start.wait()
        try:
            while not done.is_set():
                list(store.list_keys("blobs/"))
        except BaseException as err:
            failures.append(err)

    threads = [threading.Thread(target=write, args=(f"w{n}",)) for n in range(writers)]
    lister = threading.Thread(target=list_all)
    for thread in [*threads, lister]:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    lister.join()

    assert failures == []
    assert list(store.list_keys("")) == []
    assert directories_under(store.root) == []


@pytest.mark.parametrize(
    "key", ["", "../x", "a/../../x", "/abs", "a//b", "a/", "./a", "a/./b", "..", "."]
)
def test_invalid_keys_are_refused_by_every_method(store: DirectoryStore, key: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: store.put(key, [b"x"]),
        lambda: store.get(key),
        lambda: store.read_into(key, memoryview(bytearray(8))),
        lambda: store.size(key),
        lambda: store.delete(key),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="invalid object key"):
            call()
    assert not (store.root.parent / "x").exists()


def failing_pieces() -> Iterator[bytes]:
    yield b"half of the new "
    raise RuntimeError("network dropped")


def test_a_failed_put_keeps_the_old_object(store: DirectoryStore) -> None:
    store.put("a/k", [b"old"])

    with pytest.raises(RuntimeError, match="network dropped"):
        store.put("a/k", failing_pieces())

    assert store.get("a/k") == b"old"
    assert list(store.list_keys("")) == ["a/k"]
    assert files_under(store.root) == ["a/k"]  # no temporary file left behind


def test_a_failed_put_of_a_new_key_leaves_nothing(store: DirectoryStore) -> None:
    with pytest.raises(RuntimeError):
        store.put("a/new", failing_pieces())

    assert store.size("a/new") is None
    assert list(store.list_keys("")) == []
    assert files_under(store.root) == []


def test_a_put_in_flight_is_invisible(store: DirectoryStore) -> None:
    store.put("k", [b"old"])
    seen: list[object] = []

    def pieces() -> Iterator[bytes]:
        yield b"new"
        seen.extend([store.get("k"), list(store.list_keys(""))])
        yield b"er"

    store.put("k", pieces())

    assert seen == [b"old", ["k"]]
    assert store.get("k") == b"newer"


def test_a_batch_of_puts_appears_on_exit_with_one_fsync_per_file_and_directory(
    store: DirectoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.put("blobs/aa/old", [b"old"])
    synced.clear()
    with store.batch():
        threads = [
            threading.Thread(target=store.put, args=(f"blobs/{d}/{n}", [d.encode(), n.encode()]))
            for d in ("aa", "bb")
            for n in ("1", "2", "3")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert synced == []
        assert list(store.list_keys("")) == ["blobs/aa/old"]  # nothing under its key yet
    assert store.get("blobs/bb/3") == b"bb3"
    assert len(list(store.list_keys("blobs/"))) == 7
    # 6 files; directories once each: blobs/aa, blobs/bb, and blobs (bb was made)
    assert len(synced) == 6 + 3
    assert files_under(store.root) == sorted(store.list_keys(""))  # no temporary file left
    store.put("after", [b"durable at once"])
    assert store.get("after") == b"durable at once"


def test_a_batch_that_raises_leaves_no_object(store: DirectoryStore) -> None:
    with pytest.raises(RuntimeError, match="upload failed"), store.batch():
        store.put("a/1", [b"one"])
        raise RuntimeError("upload failed")
    assert files_under(store.root) == []
    with store.batch(), pytest.raises(RuntimeError, match="open already"), store.batch():
        pass


def test_open_store_with_a_path(tmp_path: Path) -> None:
    opened = open_store(str(tmp_path / "s"))

    assert isinstance(opened, DirectoryStore)
    assert opened.root == tmp_path / "s"


def test_open_store_with_a_file_url_reaches_the_same_objects(tmp_path: Path) -> None:
    by_path = open_store(str(tmp_path))
    by_path.put("k", [b"v"])

    by_url = open_store((tmp_path).as_uri())

    assert isinstance(by_url, DirectoryStore)
    assert by_url.root == tmp_path
    assert by_url.get("k") == b"v"
    assert open_store(by_path.url).get("k") == b"v"


def test_open_store_with_a_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    opened = open_store(".ckpt/store")

    assert isinstance(opened, DirectoryStore)
    assert opened.root == tmp_path / ".ckpt" / "store"


@pytest.mark.parametrize("url", ["gs://bucket", "http://host/x"])
def test_open_store_refuses_other_schemes(url: str) -> None:
    with pytest.raises(ValueError, match="unsupported store URL"):
        open_store(url)


SHA = "ab" + "0123456789abcdef" * 3 + "0123456789abcd"


def test_blob_key_spreads_by_hash_prefix() -> None:
    assert len(SHA) == 64
    assert keys.blob_key(SHA) == f"blobs/sha256/ab/{SHA}"


@pytest.mark.parametrize(
    ("key", "named"),
    [
        (f"blobs/sha256/ab/{SHA}", SHA),
        (f"blobs/sha256/cd/{SHA}", None),  # a prefix that is not the hash's
        (f"blobs/sha256/AB/{SHA.upper()}", None),
        (f"blobs/sha256/ab/{SHA[:-1]}", None),
        (f"runs/r/blobs/sha256/ab/{SHA}", None),
        ("blobs/small", None),
    ],
)
def test_only_a_blob_key_names_the_sha256_of_its_bytes(key: str, named: str | None) -> None:
    assert keys.blob_sha256(key) == named


def test_manifest_key_pads_the_step() -> None:
    assert keys.manifest_key("run-1", 42) == "runs/run-1/bundles/000000000042/manifest.json"
    assert keys.manifest_key("r", 0) == "runs/r/bundles/000000000000/manifest.json"
    assert keys.bundles_prefix("r") == "runs/r/bundles/"
    assert keys.manifest_key("r", 7).startswith(keys.bundles_prefix("r"))


def test_manifest_keys_sort_by_position() -> None:
    """A later micro step of a step sorts after its micro step 0 and before the next step."""
    positions = [(3000, 0), (5, 2), (5, 0), (100, 0), (5, 10), (20, 1), (0, 0), (999_999, 0)]

    ordered = sorted(keys.manifest_key("r", *position) for position in positions)

    assert [keys.manifest_position(key) for key in ordered] == sorted(positions)


def test_micro_step_zero_keeps_the_key_of_a_step() -> None:
    assert keys.manifest_key("r", 6, 0) == keys.manifest_key("r", 6)
    assert keys.manifest_key("r", 6, 2) == "runs/r/bundles/000000000006_000002/manifest.json"


@settings(database=None, deadline=None)
@given(st.integers(0, 10**12 - 1), st.integers(0, 10**7))
def test_manifest_position_parses_manifest_key(step: int, micro_step: int) -> None:
    key = keys.manifest_key("run.v2_x", step, micro_step)
    assert keys.manifest_position(key) == (step, micro_step)


@pytest.mark.parametrize(
    "key",
    [
        f"blobs/sha256/ab/{SHA}",
        "runs/r/bundles/42/manifest.json",
        "runs/r/bundles/000000000042/other.json",
        "runs/r/bundles/000000000042/manifest.json.tmp",
        "runs/a/b/bundles/000000000042/manifest.json",
        "runs//bundles/000000000042/manifest.json",
        "x/runs/r/bundles/000000000042/manifest.json",
        "runs/r/bundles/00000000004a/manifest.json",
        "runs/r/bundles/000000000042_/manifest.json",
        "runs/r/bundles/000000000042_2/manifest.json",
        "runs/r/bundles/000000000042/rank-00000.json",
        "",
    ],
)
def test_manifest_position_is_none_for_other_keys(key: str) -> None:
    assert keys.manifest_position(key) is None


@pytest.mark.parametrize("run", ["a", "Run-1", "llama_7b.v2", "0", "a" * 128])
def test_valid_run_names(run: str) -> None:
    assert keys.check_run_name(run) == run


@pytest.mark.parametrize(
    "run", ["", "-a", ".a", "_a", "a/b", "a b", "a" * 129, "é", "..", "a:b", "a\\b"]
)
def test_invalid_run_names(run: str) -> None:
    with pytest.raises(ValueError, match="invalid run name"):
        keys.check_run_name(run)
    with pytest.raises(ValueError, match="invalid run name"):
        keys.manifest_key(run, 1)


def test_a_directory_store_url_reopens_the_same_directory(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "a b%20c")
    assert open_store(store.url).root == store.root  # type: ignore[attr-defined]


def test_a_file_url_with_a_host_is_refused() -> None:
    with pytest.raises(ValueError, match="file:///absolute/path"):
        open_store("file://relative/path")


@pytest.mark.parametrize("key", ["a/.x", ".hidden", "a/.b/c"])
def test_keys_with_dot_parts_are_reserved(store: DirectoryStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid object key"):
        store.put(key, [b"1"])


@pytest.mark.parametrize("run", ["run\n", "run\nx"])
def test_run_names_with_newlines_are_refused(run: str) -> None:
    with pytest.raises(ValueError, match="invalid run name"):
        keys.check_run_name(run)


def test_manifest_position_needs_the_whole_key() -> None:
    assert keys.manifest_position(keys.manifest_key("r", 1) + "\n") is None


def test_steps_past_twelve_digits_still_parse() -> None:
    assert keys.manifest_position(keys.manifest_key("r", 10**12)) == (10**12, 0)
