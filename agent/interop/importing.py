"""``import_checkpoint``: another tool's checkpoint committed as a bundle of a run.

The source is read (``sources``, ``dicts``) into ckpt's layers; a layer it cannot fill is
named, and the import stops unless the user accepted exactly those layers as missing
(``accept_missing``): then the manifest records the bundle as *imported, partial*, and a
resume restores the other layers only. The layers are uploaded as any save's are (cut
into blobs, hashed, stored unless held) and the manifest is written last, at the
source's step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.catalog.client import ControlPlane
from agent.catalog.manifests import bundle_name
from agent.config import Config
from agent.interop.commit import commit_through, commit_to_store
from agent.interop.dicts import read_dcp, read_torch
from agent.interop.found import Found
from agent.interop.sources import read_hf, read_lightning
from ckpt.core.contract import RESTORE_ORDER, Imported, ImportFormat, Layer, Manifest
from ckpt.core.errors import ImportSourceError
from ckpt.core.storage import ObjectStore, open_store
from ckpt.core.tokens import default_token

__all__ = ["ImportResult", "detect_format", "import_checkpoint"]

log = logging.getLogger("ckpt")

READERS: dict[ImportFormat, Callable[..., Found]] = {
    "hf": read_hf,
    "lightning": read_lightning,
    "dcp": read_dcp,
    "torch": read_torch,
}


@dataclass(frozen=True)
class ImportResult:
    """The bundle an import committed, and the layers it lacks (accepted as missing)."""

    bundle: str
    step: int
    format: ImportFormat
    layers: tuple[Layer, ...]
    missing: dict[Layer, str]

    @property
    def partial(self) -> bool:
        return bool(self.missing)


def detect_format(source: Path) -> ImportFormat:
    """Which reader a path needs, from what it holds.

    Raises:
        ImportSourceError: the path is missing or its format cannot be told (pass it).
    """
    if source.is_dir():
        if (source / "trainer_state.json").is_file():
            return "hf"
        if (source / ".metadata").is_file():
            return "dcp"
        raise ImportSourceError(
            f"{source}: a directory with neither trainer_state.json (a Hugging Face Trainer "
            "checkpoint) nor .metadata (DCP)"
        )
    if not source.is_file():
        raise ImportSourceError(f"{source}: no such file or directory")
    return "lightning" if source.suffix == ".ckpt" else "torch"


def import_checkpoint(
    source: str | Path,
    *,
    run: str,
    store: str | ObjectStore | None = None,
    server: str | None = None,
    token: str | None = None,
    source_format: ImportFormat | None = None,
    accept_missing: Iterable[Layer | str] = (),
    unsafe_unpickle: bool = False,
) -> ImportResult:
    """Commit the checkpoint at ``source`` as a bundle of ``run``, at the source's step.

    Args:
        source: a Hugging Face Trainer ``checkpoint-N/`` folder, a Lightning ``.ckpt``, a
            DCP directory or a ``torch.save`` file (docs/interop.md lists the keys read).
        run: the run the bundle joins.
        store: where bundles go (``CKPT_STORE`` when left out).
        server: commit through this control plane (``CKPT_SERVER``); it registers an
            attempt of the run, which fences a job of the run still running.
        token: the control plane's bearer token (``CKPT_TOKEN``).
        source_format: ``hf``, ``lightning``, ``dcp`` or ``torch`` (told from the path when
            left out).
        accept_missing: exactly the layers the source cannot fill, accepted as missing: the
            bundle is then *imported, partial*.
        unsafe_unpickle: allow unpickling objects beyond tensors and containers (only
            for a file you trust).

    Returns:
        The bundle committed and the layers it lacks.

    Raises:
        ImportSourceError: a file is damaged or unsafe to unpickle, or the layers the
            source lacks are not exactly ``accept_missing`` (the message names them).
        BundleExistsError: the run has a bundle at the source's step already.
        ControlPlaneError: the control plane refused the bundle (its message says why).
        ValueError: bad configuration (the run's name, the store).
    """
    path = Path(source)
    named = store if isinstance(store, str) else None
    config = Config.resolve({"run": run, "store": named, "server": server, "token": token})
    accepted = _layers(accept_missing)
    kind = source_format or detect_format(path)
    if kind not in READERS:
        raise ImportSourceError(f"unknown format {kind!r}: use one of {', '.join(READERS)}")
    found = READERS[kind](path, unsafe=unsafe_unpickle)
    _check_missing(found, accepted)
    imported = Imported(format=kind, source=str(path), missing=tuple(found.missing))
    target = open_store(config.store) if store is None or isinstance(store, str) else store
    manifest = _commit(config, target, found, imported=imported)
    log.info("run %s: imported %s as %s", config.run, path, bundle_name(manifest))
    return ImportResult(
        bundle=bundle_name(manifest),
        step=manifest.step,
        format=kind,
        layers=tuple(layer for layer in RESTORE_ORDER if layer in found.layers),
        missing=dict(found.missing),
    )


def _layers(names: Iterable[Layer | str]) -> set[Layer]:
    known = {str(layer) for layer in RESTORE_ORDER}
    unknown = [str(name) for name in names if str(name) not in known]
    if unknown:
        raise ImportSourceError(
            f"--accept-missing names no layer {', '.join(unknown)}: the layers are "
            f"{', '.join(sorted(known, key=[str(x) for x in RESTORE_ORDER].index))}"
        )
    return {Layer(name) for name in names}


def _check_missing(found: Found, accepted: set[Layer]) -> None:
    """Go on only when the layers the source lacks are exactly those accepted."""
    missing = set(found.missing)
    if missing == accepted:
        return
    lacking = "; ".join(f"{layer}: {why}" for layer, why in found.missing.items())
    if missing - accepted:
        names = ",".join(str(layer) for layer in RESTORE_ORDER if layer in missing)
        raise ImportSourceError(
            f"{found.path}: cannot fill every layer ({lacking}). A bundle without them is not "
            f"a bit-exact resume; to import it as partial all the same, pass "
            f"--accept-missing {names}"
        )
    extra = ", ".join(str(layer) for layer in RESTORE_ORDER if layer in accepted - missing)
    raise ImportSourceError(
        f"{found.path}: --accept-missing names {extra}, which the source fills; name exactly "
        f"the missing layers ({', '.join(map(str, found.missing)) or 'none'})"
    )


def _commit(config: Config, store: ObjectStore, found: Found, *, imported: Imported) -> Manifest:
    """Through the control plane when ``config.server`` names one, else to the store."""
    if not config.server:
        return commit_to_store(
            store, found, run=config.run, blob_bytes=config.blob_bytes, imported=imported
        )
    control = ControlPlane(
        config.server,
        token=config.token or default_token(),
        retry_seconds=config.server_retry_seconds,
    )
    try:
        return commit_through(
            control, store, found, run=config.run, blob_bytes=config.blob_bytes, imported=imported
        )
    finally:
        control.close()
