"""The skeleton codec: what round-trips, what is refused at save, what is refused at load."""

from __future__ import annotations

import json
import math
import pickle
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.format import skeleton
from agent.format.skeleton import JSON
from ckpt.core.errors import BundleFormatError, UnrepresentableStateError


def same(left: Any, right: Any) -> bool:
    """Structural equality that also compares types, NaN, -0.0, dtypes and dict order."""
    if type(left) is not type(right):
        return False
    if isinstance(left, float):
        return same_float(left, right)
    if isinstance(left, torch.Tensor | np.ndarray | np.generic):
        return same_array(left, right)
    if isinstance(left, list | tuple | dict):
        return same_items(left, right)
    return bool(left == right)


def same_float(left: float, right: float) -> bool:
    if math.isnan(left):
        return math.isnan(right)
    return left == right and math.copysign(1.0, left) == math.copysign(1.0, right)


def same_array(left: Any, right: Any) -> bool:
    if left.dtype != right.dtype or left.shape != right.shape:
        return False
    if isinstance(left, torch.Tensor):
        return torch.equal(left, right)
    return bool(left.tobytes() == right.tobytes())


def same_items(left: Any, right: Any) -> bool:
    if isinstance(left, dict):
        left, right = list(left.items()), list(right.items())
    return len(left) == len(right) and all(map(same, left, right))


def round_trip(state: object) -> Any:
    """Encode, store the skeleton as strict JSON text, load it back and decode."""
    encoded, tensors = skeleton.encode(state)
    text = json.dumps(encoded, allow_nan=False)
    return skeleton.decode(json.loads(text), tensors)


def test_same_tells_apart_what_the_round_trip_must_keep() -> None:
    assert not same((1, 2), [1, 2])
    assert not same(1, True)
    assert not same(1, 1.0)
    assert not same(0.0, -0.0)
    assert not same(np.float32(1), np.float64(1))
    assert not same(np.zeros(1), np.zeros(()))
    assert not same({1: "a", 2: "b"}, {2: "b", 1: "a"})
    assert same(float("nan"), float("nan"))


@pytest.mark.parametrize(
    "state",
    [
        None,
        True,
        0,
        -(2**70),
        1.5,
        -0.0,
        "text",
        [],
        {},
        (),
        [1, [2, [3, (4, 5)]]],
        {"a": {"b": [1, 2.5, None, "x"]}, "c": (True, False)},
        {1: "one", 2: {3: "three"}},
        {"$tensor": "not a tag", "plain": 1},
        {"$only": 1},
        {(1, "a"): "tuple key", None: 0, 2.5: "float key", False: "bool key"},
        {"nested": ((), [()], ((1,),))},
        b"\x00\xffbytes",
        {"blob": b""},
        torch.float32,
        [torch.bfloat16, torch.bool, torch.uint32, torch.float8_e4m3fn],
        torch.device("cpu"),
        {"device": torch.device("cuda", 1), "meta": torch.device("meta")},
    ],
)
def test_round_trip_keeps_values_and_types(state: object) -> None:
    assert same(round_trip(state), state)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_round_trip_through_strict_json(value: float) -> None:
    state = {"loss": value, "history": [1.0, value], "pair": (value,)}

    encoded, _ = skeleton.encode(state)

    json.dumps(encoded, allow_nan=False)  # would raise if a bare NaN/inf leaked through
    assert same(round_trip(state), state)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([True, False]),
        np.array([0, 2**32 - 1], dtype=np.uint32),
        np.array([-1, 7], dtype=np.int8),
        np.array([0.5, np.nan], dtype=np.float16),
        np.zeros((0, 4), dtype=np.float64),
        np.arange(12, dtype=np.int64).reshape(3, 4).T,  # not contiguous
    ],
)
def test_numpy_arrays_round_trip(array: np.ndarray[Any, Any]) -> None:
    result = round_trip({"array": array})["array"]

    assert same(result, array)
    assert not np.shares_memory(result, array)


@pytest.mark.parametrize(
    "scalar",
    [
        np.float32(1.25),
        np.float32(-0.0),
        np.float16(np.nan),
        np.float32(-np.inf),
        np.int8(-128),
        np.uint64(2**64 - 1),
        np.int64(-(2**63)),
        np.bool_(True),
    ],
)
def test_numpy_scalars_round_trip_with_their_dtype(scalar: np.generic) -> None:
    assert same(round_trip([scalar]), [scalar])


@pytest.mark.parametrize("value", [1.5, -0.0, 1e300, math.inf, -math.inf, math.nan])
def test_numpy_float64_keeps_its_type_and_value(value: float) -> None:
    # np.float64 subclasses float; it must not be stored as repr() text "np.float64(inf)".
    assert same(round_trip([np.float64(value)]), [np.float64(value)])


@pytest.mark.parametrize(
    "array",
    [
        np.array(3.5),
        np.arange(6, dtype=">f4").reshape(2, 3),
        np.arange(6, dtype=np.int16)[::2],
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    ],
    ids=["0-d", "big-endian", "strided", "fortran"],
)
def test_arrays_keep_shape_and_values(array: np.ndarray) -> None:
    (restored,) = round_trip([array])
    assert restored.shape == array.shape
    assert np.array_equal(restored, array)


def test_a_read_only_array_is_copied_without_warning() -> None:
    array = np.arange(3)
    array.flags.writeable = False
    (restored,) = round_trip([array])
    assert np.array_equal(restored, array)


@pytest.mark.parametrize("key", [b"k", np.int64(3), torch.float32, torch.device("cpu"), (1, b"x")])
def test_dict_keys_that_cannot_come_back_are_refused_at_save(key: object) -> None:
    with pytest.raises(UnrepresentableStateError, match="a dict key"):
        skeleton.encode({"outer": {key: 1}}, root=("extras",))


@pytest.mark.parametrize(
    "crafted",
    [
        {"$dict": [[1, 2, 3]]},
        {"$numpy": ["zz", 1]},
        {"$numpy": ["|i1", 1000]},
        {"$bytes": "!!"},
        {"$device": "nope"},
        {"$dict": [[{"$tuple": [[1]]}, 1]]},
    ],
)
def test_malformed_tags_raise_bundle_format_error(crafted: Any) -> None:
    with pytest.raises(BundleFormatError):
        skeleton.decode(crafted, {})


def test_tensors_are_stored_by_key_path_and_decoded_by_name() -> None:
    weight, bias = torch.randn(3, 2), torch.zeros(2, dtype=torch.bfloat16)
    state = {"layer": {"weight": weight, "bias": bias}, "steps": [torch.tensor(3)]}

    encoded, tensors = skeleton.encode(state, root=("weights",))

    assert set(tensors) == {"weights/layer/weight", "weights/layer/bias", "weights/steps/0"}
    assert tensors["weights/layer/weight"] is weight
    assert encoded == {
        "layer": {
            "weight": {"$tensor": "weights/layer/weight"},
            "bias": {"$tensor": "weights/layer/bias"},
        },
        "steps": [{"$tensor": "weights/steps/0"}],
    }
    assert same(skeleton.decode(encoded, tensors), state)


def test_tied_tensors_are_stored_once_and_stay_tied() -> None:
    shared = torch.randn(4, 4)
    state = {"embed": shared, "head": shared, "copy": shared.clone()}

    encoded, tensors = skeleton.encode(state)
    result = skeleton.decode(json.loads(json.dumps(encoded)), tensors)

    assert len(tensors) == 2
    assert result["embed"] is result["head"]
    assert result["copy"] is not result["embed"]
    assert torch.equal(result["copy"], shared)


def test_colliding_tensor_names_stay_distinct() -> None:
    first, second = torch.zeros(1), torch.ones(1)
    state = {"a": {"b": first}, "a/b": second}

    _, tensors = skeleton.encode(state)
    result = round_trip(state)

    assert len(tensors) == 2
    assert torch.equal(result["a"]["b"], first)
    assert torch.equal(result["a/b"], second)


def test_a_bare_tensor_is_named_root() -> None:
    tensor = torch.arange(3)

    encoded, tensors = skeleton.encode(tensor)

    assert encoded == {"$tensor": "<root>"}
    assert skeleton.decode(encoded, tensors) is tensor


def test_int_keyed_optimizer_state_round_trips() -> None:
    state = {
        "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(3)}, 7: {}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 7]}],
    }

    result = round_trip(state)

    assert same(result, state)
    assert list(result["state"]) == [0, 7]


json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN, inf and -0.0 included
    st.text(max_size=8),
    st.binary(max_size=8),
)
dict_keys = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["$tensor", "$tuple", "$dict", "$", "$pickle"]),
    st.integers(),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.tuples(st.integers(), st.text(max_size=3)),
)
trees = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
        st.dictionaries(dict_keys, children, max_size=4),
    ),
    max_leaves=25,
)


@settings(database=None, deadline=None, max_examples=200)
@given(trees)
def test_round_trip_of_json_like_trees(state: object) -> None:
    assert same(round_trip(state), state)


@settings(database=None, deadline=None, max_examples=100)
@given(trees)
def test_skeleton_is_plain_json_and_names_no_tensor(state: object) -> None:
    encoded, tensors = skeleton.encode(state)

    assert tensors == {}
    assert json.loads(json.dumps(encoded, allow_nan=False)) == encoded


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (Opaque(), "Opaque"),
        ({1, 2}, "set"),
        (lambda: 0, "function"),
        (np.array([object()], dtype=object), "ndarray"),
        (np.array(["a", "b"]), "ndarray"),
        (torch.zeros(2, 2).to_sparse(), "sparse"),
        (torch.zeros(2, device="meta"), "meta"),
    ],
)
def test_unrepresentable_values_are_refused_with_their_key_path(value: object, kind: str) -> None:
    state = {"state": {3: {"foo": value}}}

    with pytest.raises(UnrepresentableStateError) as caught:
        skeleton.encode(state, root=("optimizer",))

    assert "optimizer/state/3/foo" in str(caught.value)
    assert kind in str(caught.value)
    assert isinstance(caught.value, TypeError)


def test_the_path_of_a_refused_value_inside_lists_and_tuples() -> None:
    with pytest.raises(UnrepresentableStateError, match=r"^data/0/pipeline/1: "):
        skeleton.encode([{"pipeline": ("ok", object())}], root=("data",))


def test_a_tensor_as_dict_key_is_refused_with_its_path() -> None:
    state = {"table": {torch.zeros(1): 1}}

    with pytest.raises(UnrepresentableStateError, match=r"^weights/table: .*Tensor"):
        skeleton.encode(state, root=("weights",))


@pytest.fixture
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode must never unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.usefixtures("no_pickle")
@pytest.mark.parametrize(
    "bad",
    [
        {"$pickle": "gASVBAAAAAAAAACMAXiULg=="},
        {"$tensor": "x", "extra": 1},
        {"$tuple": [1], "$dict": []},
        {"$object": {"module": "os", "name": "system"}},
        {"ok": [1, {"$reduce": ["os.system", ["echo"]]}]},
        {"$tuple": [{"$pickle": ""}]},
        {"$tuple": "not a list"},
        {"$dict": {"a": 1}},
        {"$dict": [[[1, 2], "list keys are unhashable"]]},
        {"$tensor": "missing"},
        {"$tensor": 3},
        {"$ndarray": "missing"},
        {"$float": "1.5"},
        {"$float": 1.5},
        {"$numpy": ["|O", 1]},
        {"$numpy": ["<U3", "abc"]},
        {"$dtype": "Tensor"},
        {"$dtype": "load"},
        {"$dtype": 5},
        {"$bytes": 5},
        {"$device": 0},
    ],
)
def test_decode_rejects_unknown_or_malformed_tags(bad: JSON) -> None:
    with pytest.raises(BundleFormatError):
        skeleton.decode(bad, {"x": torch.zeros(1)})


@pytest.mark.usefixtures("no_pickle")
def test_decode_of_every_tag_needs_no_pickle() -> None:
    state = {
        "t": torch.ones(2),
        "a": np.ones(2),
        "tuple": (1,),
        "ints": {1: 2},
        "nan": math.nan,
        "np": np.int32(4),
        "b": b"x",
        "dtype": torch.int8,
        "device": torch.device("cpu"),
    }

    assert same(round_trip(state), state)


def test_render_path_joins_keys_with_slashes() -> None:
    assert skeleton.render_path(("optimizer", "state", 3, "exp_avg")) == "optimizer/state/3/exp_avg"
    assert skeleton.render_path(()) == ""


def test_a_dtype_without_safetensors_code_is_refused_at_encode_with_its_path() -> None:
    with pytest.raises(
        UnrepresentableStateError, match=r"optimizer/state/0/z: dtype torch.complex64"
    ):
        skeleton.encode(
            {"state": {0: {"z": torch.zeros(2, dtype=torch.complex64)}}}, root=("optimizer",)
        )


def test_a_dtype_tag_never_imports_anything() -> None:
    before = set(sys.modules)
    for name in ("_dynamo", "onnx", "load", "os"):
        with pytest.raises(BundleFormatError):
            skeleton.decode({"$dtype": name}, {})
    assert set(sys.modules) == before
    assert skeleton.decode({"$dtype": "bfloat16"}, {}) is torch.bfloat16
