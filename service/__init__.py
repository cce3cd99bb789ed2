"""ckpt control plane.

This package's top level imports only the standard library: the agent imports ``service.contract`` (the wire
contract, pydantic only) without pulling in the web stack, and importing the service never
loads torch.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ckpt")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
