"""Split a state object into a JSON skeleton and named tensors, and join them back.

The skeleton is plain JSON. Values JSON cannot carry are written as tagged one-key
objects (``{"$tensor": name}``, ``{"$tuple": [...]}``...). Decoding knows only these tags,
builds only these types and never imports or calls anything named by the data, so loading
a skeleton cannot execute code. A value outside this vocabulary is refused at save time
with its key path.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import numpy as np
import torch

from agent.format.dtypes import DTYPES
from agent.format.sharding import Block
from ckpt.core.errors import BundleFormatError, UnrepresentableStateError

JSON: TypeAlias = bool | int | float | str | list["JSON"] | dict[str, "JSON"] | None
KeyPath: TypeAlias = tuple[object, ...]

_NUMPY_KINDS = "biuf"  # bool, signed, unsigned, float: no object, string or datetime arrays
# A fixed table: getattr(torch, name) could import lazily loaded torch submodules.
_TORCH_DTYPE_NAMES = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}


def render_path(path: KeyPath) -> str:
    """The human- and tensor-name form of a key path: ``optimizer/state/0/exp_avg``."""
    return "/".join(str(key) for key in path)


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[tuple[object, ...], str] = {}

    def encode(self, value: object, path: KeyPath) -> JSON:
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, np.generic):  # before int/float: np.float64 is a float subclass
            return self._encode_numpy_scalar(value, path)
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
        if _is_dtensor(value):
            return self._encode_dtensor(value, path)
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._tensor_name(value, path)}
        if isinstance(value, list):
            return [self.encode(item, (*path, i)) for i, item in enumerate(value)]
        if isinstance(value, tuple):
            return {"$tuple": [self.encode(item, (*path, i)) for i, item in enumerate(value)]}
        if isinstance(value, dict):
            return self._encode_dict(value, path)
        return self._encode_other(value, path)

    def _encode_dict(self, value: dict[object, object], path: KeyPath) -> JSON:
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {str(key): self.encode(item, (*path, key)) for key, item in value.items()}
        pairs: list[JSON] = [
            [self._encode_key(key, path), self.encode(item, (*path, key))]
            for key, item in value.items()
        ]
        return {"$dict": pairs}

    def _encode_key(self, key: object, path: KeyPath) -> JSON:
        if not _plain_key(key):
            raise UnrepresentableStateError(
                f"{render_path(path)}: a dict key of type {type(key).__name__} cannot be stored; "
                "use str, int, float, bool, None or tuples of them"
            )
        return self.encode(key, (*path, "<key>"))

    def _encode_dtensor(self, value: Any, path: KeyPath) -> JSON:
        """A tensor sharded over ranks (FSDP2): this rank's block, and where it lies in the
        whole (decoded as a ``sharding.Block``)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if not all(isinstance(p, Shard | Replicate) for p in value.placements):
            raise UnrepresentableStateError(
                f"{render_path(path)}: a DTensor placed {value.placements} cannot be stored; "
                "only Shard and Replicate placements (FSDP2's) are"
            )
        local = value.to_local()
        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return {
            "$dtensor": {
                "local": self._tensor_name(local, path),
                "shape": list(value.shape),
                "offset": list(offset),
            }
        }

    def _encode_numpy_scalar(self, value: np.generic, path: KeyPath) -> JSON:
        if value.dtype.kind not in _NUMPY_KINDS:
            return self._refuse(value, path)
        return {"$numpy": [value.dtype.str, self.encode(value.item(), path)]}

    def _encode_other(self, value: object, path: KeyPath) -> JSON:
        if isinstance(value, np.ndarray) and value.dtype.kind in _NUMPY_KINDS:
            # A native-byte-order, writable, C-ordered copy (0-d arrays keep their shape).
            native = value.astype(value.dtype.newbyteorder("="), order="C", copy=True)
            try:
                tensor = torch.from_numpy(native)
            except TypeError:
                return self._refuse(value, path)
            return {"$ndarray": self._tensor_name(tensor, path)}
        if isinstance(value, bytes):
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, torch.dtype):
            return {"$dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$device": str(value)}
        return self._refuse(value, path)

    @staticmethod
    def _refuse(value: object, path: KeyPath) -> JSON:
        kind = type(value).__qualname__
        if isinstance(value, np.ndarray | np.generic):
            kind += f" of dtype {value.dtype}"
        raise UnrepresentableStateError(
            f"{render_path(path)}: cannot store a value of type {kind} "
            "without pickle; make state_dict() return tensors, numbers, strings, bytes, "
            "None, lists, tuples and dicts"
        )

    def _tensor_name(self, tensor: torch.Tensor, path: KeyPath) -> str:
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise UnrepresentableStateError(
                f"{render_path(path)}: {tensor.layout} tensors are not supported; store a dense copy"
            )
        if tensor.device.type == "meta":
            raise UnrepresentableStateError(f"{render_path(path)}: a meta tensor holds no data")
        if tensor.dtype not in DTYPES:
            raise UnrepresentableStateError(
                f"{render_path(path)}: dtype {tensor.dtype} has no safetensors code; "
                f"store it as one of {', '.join(str(d) for d in DTYPES)}"
            )
        # The same memory twice (tied weights, which state_dict() returns as two distinct
        # detached tensors) is stored once, and both references decode to one tensor.
        memory = _memory_identity(tensor)
        known = self._names.get(memory)
        if known is not None:
            return known
        name = render_path(path) or "<root>"
        while name in self.tensors:
            name += "'"
        self.tensors[name] = tensor
        self._names[memory] = name
        return name


def _is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (without importing it
    for processes that never use one)."""
    return isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor"


def _memory_identity(tensor: torch.Tensor) -> tuple[object, ...]:
    if tensor.numel() == 0:
        return ("object", id(tensor))
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.device,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.is_neg(),
        tensor.is_conj(),
    )


def _plain_key(key: object) -> bool:
    """Keys the decoder can rebuild as themselves: JSON scalars and tuples of them."""
    if isinstance(key, tuple):
        return all(_plain_key(item) for item in key)
    return key is None or type(key) in (str, int, float, bool)


def encode(state: object, *, root: KeyPath = ()) -> tuple[JSON, dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON skeleton and the tensors it references by name.

    Raises:
        UnrepresentableStateError: a value has no safe representation; the message names
            its key path under ``root``.
    """
    encoder = _Encoder()
    skeleton = encoder.encode(state, root)
    return skeleton, encoder.tensors


def decode(skeleton: JSON, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the state object from a skeleton and the named tensors it references.

    Raises:
        BundleFormatError: an unknown tag, a malformed tagged value or a missing tensor.
    """
    try:
        return _Decoder(tensors).decode(skeleton)
    except BundleFormatError:
        raise
    except (ValueError, TypeError, OverflowError, RuntimeError) as err:
        raise BundleFormatError(f"malformed skeleton: {err}") from err


class _Decoder:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._tags: dict[str, Callable[[JSON], object]] = {
            "$tensor": self._tensor,
            "$ndarray": lambda name: self._tensor(name).numpy().copy(),
            "$tuple": lambda items: tuple(self._items(items)),
            "$dict": self._dict,
            "$float": self._float,
            "$numpy": self._numpy,
            "$bytes": self._bytes,
            "$dtype": self._dtype,
            "$device": lambda text: torch.device(_expect(text, str)),
            "$dtensor": self._dtensor,
        }

    def decode(self, value: JSON) -> object:
        if isinstance(value, list):
            return self._items(value)
        if not isinstance(value, dict):
            return value
        tagged = [key for key in value if key.startswith("$")]
        if not tagged:
            return {key: self.decode(item) for key, item in value.items()}
        if len(value) != 1 or tagged[0] not in self._tags:
            raise BundleFormatError(f"unknown or malformed tagged value with keys {sorted(value)}")
        return self._tags[tagged[0]](value[tagged[0]])

    def _items(self, items: JSON) -> list[object]:
        return [self.decode(item) for item in _expect(items, list)]

    def _tensor(self, name: JSON) -> torch.Tensor:
        try:
            return self._tensors[_expect(name, str)]
        except KeyError:
            raise BundleFormatError(
                f"the skeleton references tensor {name!r}, which the payload lacks"
            ) from None

    def _dtensor(self, fields: JSON) -> Block:
        record = _expect(fields, dict)
        shape, offset = _expect(record.get("shape"), list), _expect(record.get("offset"), list)
        if not all(type(n) is int for n in (*shape, *offset)):
            raise BundleFormatError("$dtensor shape and offset must be lists of integers")
        return Block(
            shape=tuple(shape), offset=tuple(offset), data=self._tensor(record.get("local"))
        )

    def _dict(self, pairs: JSON) -> dict[object, object]:
        result: dict[object, object] = {}
        for pair in _expect(pairs, list):
            key, item = _expect(pair, list)
            decoded_key = self.decode(key)
            if not isinstance(decoded_key, str | int | float | bool | tuple | None):
                raise BundleFormatError(f"a dict key decodes to {type(decoded_key).__name__}")
            result[decoded_key] = self.decode(item)
        return result

    @staticmethod
    def _float(text: JSON) -> float:
        if text not in ("nan", "inf", "-inf"):
            raise BundleFormatError(f"$float must be nan, inf or -inf, not {text!r}")
        return float(_expect(text, str))

    def _numpy(self, pair: JSON) -> object:
        dtype_text, item = _expect(pair, list)
        dtype = np.dtype(_expect(dtype_text, str))
        if dtype.kind not in _NUMPY_KINDS:
            raise BundleFormatError(f"$numpy dtype {dtype_text!r} is not numeric")
        return dtype.type(self.decode(item))

    @staticmethod
    def _bytes(text: JSON) -> bytes:
        return base64.b64decode(_expect(text, str), validate=True)

    @staticmethod
    def _dtype(name: JSON) -> torch.dtype:
        dtype = _TORCH_DTYPE_NAMES.get(_expect(name, str))
        if dtype is None:
            raise BundleFormatError(f"$dtype {name!r} is not a torch dtype")
        return dtype


def _expect(value: JSON, kind: type[Any]) -> Any:
    if not isinstance(value, kind):
        raise BundleFormatError(
            f"expected {kind.__name__} in a tagged value, got {type(value).__name__}"
        )
    return value
