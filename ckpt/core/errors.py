"""Errors raised by the ckpt agent.

    CkptError                   -- catch this to handle anything the agent raises on purpose
    ├── UnrepresentableStateError  save: a state value has no safe representation (names its key path)
    ├── BundleFormatError          restore: a payload or manifest is malformed or uses an unknown tag
    ├── CorruptBundleError         restore: a blob is missing, has the wrong size or the wrong SHA-256
    ├── IncompatibleBundleError    restore: the bundle does not fit the objects it is restored into
    ├── BundleExistsError          save: store-only, a resumable bundle at this position that this process did not resume past
    ├── RankError                  the ranks of a job could not meet, or disagree (a step, a result)
    ├── ImportSourceError          import: a checkpoint is damaged, unsafe to unpickle, or lacks layers
    ├── ResumeDivergedError        a resume's replayed steps differ from the interrupted attempt's (CKPT_VERIFY_STOP)
    ├── StoreError                 the object store failed to read or write a key
    │   ├── BadObjectError         the store answered: no such key, or an object too large
    │   └── StoreAccessError       no credentials for the store, or it refused them: not retried
    └── ControlPlaneError          the control plane refused a request or is unreachable
        ├── FencedError            a newer attempt of the run registered; stop writing
        └── SaveLostError          a save deferred through an outage cannot be committed; the next replaces it

Bad configuration raises ``ValueError`` at construction, with what to change.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base class of every error the agent raises on purpose."""


class UnrepresentableStateError(CkptError, TypeError):
    """A value in a state dict cannot be stored without pickle."""


class StateChangedError(CkptError):
    """Training changed a tensor a save was still copying or writing (an in-place write to
    a parameter or optimizer state before the next optimizer step): that save is not kept."""


class BundleFormatError(CkptError):
    """A manifest or payload is malformed, or carries something the format does not allow."""


class CorruptBundleError(CkptError):
    """A blob of a bundle is missing or does not match the size and hash its manifest records."""

    def __init__(self, message: str, *, bundle: str, blob: str) -> None:
        super().__init__(message)
        self.bundle = bundle
        self.blob = blob


class IncompatibleBundleError(CkptError):
    """The bundle cannot be restored into these objects (other model, world size, devices)."""


class BundleExistsError(CkptError):
    """Store-only, the run has a resumable bundle at this position (step, micro step) and
    this process did not resume the run from before it: saving would replace the run's
    history (a warm start into the same run, or a job that did not call ``resume()``)."""


class RankError(CkptError):
    """The ranks of a job could not meet in time (a rank died or hangs), or disagree on what
    they must agree on (the step of a save)."""


class ImportSourceError(CkptError, ValueError):
    """``ckpt import`` cannot make a bundle of this checkpoint: a file is damaged or not what
    its name says, holds objects that only an unsafe unpickling loads, or the checkpoint lacks
    layers the user did not accept without (the message names the file or the layers)."""


class ResumeDivergedError(CkptError):
    """The steps a resumed attempt replayed differ from what the interrupted attempt computed
    (raised only with ``CKPT_VERIFY_STOP``; else a warning): the resume is not bit-exact."""


class StoreError(CkptError):
    """The object store could not read or write a key."""


class StoreAccessError(StoreError):
    """The store cannot be used with this process's credentials: there are none, they are
    incomplete, or the store refused them (unknown key, wrong secret, access denied). No
    retry changes that, so none is made; the message names the store and what to fix."""


class BadObjectError(StoreError):
    """The store answered that the key does not exist or holds more bytes than expected
    (as opposed to failing to answer)."""


class ControlPlaneError(CkptError):
    """The control plane refused a request or could not be reached (the message says which)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class FencedError(ControlPlaneError):
    """A newer attempt of the run registered: this process must stop writing and exit."""


class SaveLostError(ControlPlaneError):
    """A save whose commit was deferred through a control-plane outage cannot be committed
    (blobs it wrote were collected meanwhile, and its bytes are no longer at hand). Training
    goes on: the next save replaces it. Raised only by that save's ``PendingSave.wait``."""
