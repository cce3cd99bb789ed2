"""The distribution: its name on the package index, and the installed version, recorded in
every manifest.

The distribution is ``ckpt-spot``: the name ``ckpt`` on the public index belongs to an
unrelated project. The import names (``ckpt``, ``agent``, ``service``, ``migrations``) and
the ``ckpt`` command stay; that other project also installs a ``ckpt`` module and command,
so the two cannot share one environment.
"""

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "ckpt-spot"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` of this distribution, from the index or a clone."""
    return f"pip install '{DISTRIBUTION}[{extra}]' (from a clone: pip install -e '.[{extra}]')"
