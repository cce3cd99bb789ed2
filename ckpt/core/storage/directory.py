"""The directory object store: the embedded default and the reference implementation."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from stat import S_ISREG

from ckpt.core.errors import BadObjectError, StoreError
from ckpt.core.storage.base import StoredObject


class DirectoryStore:
    """Objects as files under a root directory.

    ``put`` writes a temporary file in the target directory, fsyncs it, renames it over the
    key and fsyncs the directories it changed, so a crash leaves either the old object or the
    new one. Operating-system failures surface as ``StoreError``.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        # Parts starting with "." are refused: they are reserved for temporary files.
        if not key or any(part == "" or part.startswith(".") for part in parts):
            raise ValueError(f"invalid object key {key!r}")
        return self.root.joinpath(*parts)

    def put(self, key: str, pieces: Iterable[memoryview | bytes]) -> None:
        path = self._path(key)
        try:
            created = _make_dirs(path.parent)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as out:
                    for piece in pieces:
                        out.write(piece)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            for directory in (path.parent, *(d.parent for d in created)):
                _fsync_dir(directory)
        except OSError as err:
            raise StoreError(f"{self.url}: cannot write {key!r}: {err}") from err

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BadObjectError(f"{self.url}: no object {key!r}") from None
        except OSError as err:
            raise StoreError(f"{self.url}: cannot read {key!r}: {err}") from err

    def read_into(self, key: str, buffer: memoryview) -> int:
        try:
            with self._path(key).open("rb", buffering=0) as source:
                size = os.fstat(source.fileno()).st_size
                if size > len(buffer):
                    raise BadObjectError(
                        f"{self.url}: {key!r} holds {size} bytes, expected at most {len(buffer)}"
                    )
                filled = 0
                while filled < size:
                    count = source.readinto(buffer[filled:size])
                    if not count:
                        raise StoreError(f"{self.url}: {key!r} shrank while being read")
                    filled += count
                return size
        except FileNotFoundError:
            raise BadObjectError(f"{self.url}: no object {key!r}") from None
        except OSError as err:
            raise StoreError(f"{self.url}: cannot read {key!r}: {err}") from err

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as err:
            raise StoreError(f"{self.url}: cannot stat {key!r}: {err}") from err

    def list_keys(self, prefix: str) -> Iterator[str]:
        return (item.key for item in self.list_objects(prefix))

    def list_objects(self, prefix: str) -> Iterator[StoredObject]:
        # Walk only the deepest directory the prefix names, not the whole store.
        base = self.root.joinpath(*prefix.split("/")[:-1])
        found = []
        try:
            for path in base.rglob("*"):
                key = path.relative_to(self.root).as_posix()
                if path.name.startswith(".") or not key.startswith(prefix):
                    continue
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue  # deleted while listed
                if S_ISREG(stat.st_mode):
                    found.append(StoredObject(key, stat.st_size, stat.st_mtime))
        except OSError as err:
            raise StoreError(f"{self.url}: cannot list {prefix!r}: {err}") from err
        yield from sorted(found)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as err:
            raise StoreError(f"{self.url}: cannot delete {key!r}: {err}") from err


def _make_dirs(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; return those created, deepest first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
    return missing


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
