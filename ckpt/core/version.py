"""The installed distribution's version, recorded in every manifest."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ckpt")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
