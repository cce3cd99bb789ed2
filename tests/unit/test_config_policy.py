"""Config resolution, the save policy, the counters layer and the manifest contract."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from agent.config import DEFAULT_STORE, ENV, Config, Keywords
from agent.counters import Counters
from agent.format.chunking import DEFAULT_BLOB_BYTES
from agent.save.policy import Position, SavePolicy
from ckpt.core.contract import MANIFEST_FORMAT, Layer, Manifest, RankRecord, Versions, missing_parts
from ckpt.core.errors import UnrepresentableStateError

MIB = 1 << 20


def test_defaults() -> None:
    config = Config.resolve({"run": "r"}, env={})

    assert config == Config(run="r")
    assert config.store == DEFAULT_STORE
    assert config.blob_bytes == DEFAULT_BLOB_BYTES
    assert (config.server, config.token, config.every_steps, config.every_seconds) == (None,) * 4


def test_every_keyword_is_a_setting_of_the_environment_and_of_the_config() -> None:
    keywords = Keywords.__optional_keys__ | {"run", "store"}
    # from_run and from_step are resume()'s arguments; only their variables reach Config.
    assert keywords == ENV.keys() - {"from_run", "from_step"}
    assert keywords < Config.__dataclass_fields__.keys()


def test_a_misspelt_keyword_is_refused_not_ignored() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['every_step'\]"):
        Config.resolve({"run": "r", "every_step": 10}, env={})


def test_environment_fills_what_keywords_leave_unset() -> None:
    env = {
        "CKPT_RUN": "from-env",
        "CKPT_STORE": "/data/store",
        "CKPT_TOKEN": "secret",
        "CKPT_EVERY_STEPS": "100",
        "CKPT_EVERY_SECONDS": "1.5",
        "CKPT_BLOB_BYTES": str(2 * MIB),
    }

    config = Config.resolve({}, env=env)

    assert config == Config(
        run="from-env",
        store="/data/store",
        token="secret",
        every_steps=100,
        every_seconds=1.5,
        blob_bytes=2 * MIB,
    )


def test_keywords_win_over_the_environment() -> None:
    env = {"CKPT_RUN": "env", "CKPT_EVERY_STEPS": "100", "CKPT_BLOB_BYTES": "not even a number"}

    config = Config.resolve({"run": "kw", "every_steps": 7, "blob_bytes": 4 * MIB}, env=env)

    assert (config.run, config.every_steps, config.blob_bytes) == ("kw", 7, 4 * MIB)


def test_none_and_empty_mean_unset() -> None:
    env = {"CKPT_RUN": "env", "CKPT_EVERY_STEPS": "", "CKPT_STORE": ""}

    config = Config.resolve({"run": None, "every_steps": None, "store": None}, env=env)

    assert (config.run, config.every_steps, config.store) == ("env", None, DEFAULT_STORE)


def test_resolve_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("CKPT_STORE", "CKPT_EVERY_STEPS", "CKPT_EVERY_SECONDS", "CKPT_BLOB_BYTES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("CKPT_SERVER", raising=False)
    monkeypatch.setenv("CKPT_RUN", "from-os")

    assert Config.resolve({}).run == "from-os"


@pytest.mark.parametrize("env", [{}, {"CKPT_RUN": ""}])
def test_a_run_name_is_required(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="CKPT_RUN"):
        Config.resolve({}, env=env)


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("CKPT_EVERY_STEPS", "ten"),
        ("CKPT_EVERY_STEPS", "1.5"),
        ("CKPT_EVERY_SECONDS", "soon"),
        ("CKPT_BLOB_BYTES", "64MiB"),
    ],
)
def test_a_bad_number_in_the_environment_names_the_variable(variable: str, text: str) -> None:
    with pytest.raises(ValueError, match=f"{variable}='{text}' is not a number"):
        Config.resolve({"run": "r"}, env={variable: text})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"every_steps": 0}, "every_steps must be at least 1"),
        ({"every_steps": -5}, "every_steps must be at least 1"),
        ({"every_seconds": 0.0}, "every_seconds must be a positive number"),
        ({"every_seconds": -1.0}, "every_seconds must be a positive number"),
        ({"every_seconds": math.nan}, "every_seconds must be a positive number"),
        ({"every_seconds": math.inf}, "every_seconds must be a positive number"),
        ({"blob_bytes": MIB - 1}, "blob_bytes must be from 1 MiB to 5 GiB"),
        ({"blob_bytes": (5 << 30) + 1}, "blob_bytes must be from 1 MiB to 5 GiB"),
        ({"blob_bytes": 0}, "blob_bytes must be from 1 MiB to 5 GiB"),
        ({"run": "bad/name"}, "invalid run name"),
        ({"server": "ftp://host"}, "http"),
    ],
)
def test_invalid_settings_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config.resolve({"run": "r", **overrides}, env={})


def test_the_smallest_settings_are_accepted() -> None:
    config = Config.resolve({"run": "r", "every_steps": 1, "blob_bytes": MIB}, env={})

    assert (config.every_steps, config.blob_bytes) == (1, MIB)


def test_environment_values_are_validated_too() -> None:
    with pytest.raises(ValueError, match="every_steps must be at least 1"):
        Config.resolve({"run": "r"}, env={"CKPT_EVERY_STEPS": "0"})


@pytest.mark.parametrize(
    ("overrides", "env"),
    [
        ({"server": "https://ckpt.example"}, {}),
        ({}, {"CKPT_SERVER": "http://localhost:8000"}),
    ],
)
def test_a_control_plane_url_is_taken_from_keyword_or_environment(
    overrides: dict[str, Any], env: dict[str, str]
) -> None:
    config = Config.resolve({"run": "r", **overrides}, env=env)
    assert config.server == overrides.get("server", env.get("CKPT_SERVER"))


@pytest.mark.parametrize("url", ["ftp://ckpt.example", "ckpt.example:8470", "/a/path"])
def test_a_control_plane_url_must_be_http(url: str) -> None:
    with pytest.raises(ValueError, match=r"server must be an http\(s\) URL"):
        Config.resolve({"run": "r", "server": url}, env={})


def at(step: int, micro_step: int = 0) -> Position:
    return Position(step=step, micro_step=micro_step)


def due(
    policy: SavePolicy, position: Position, last: Position | None, seconds: float = 0.0
) -> bool:
    return policy.due(position, last=last, seconds_since_last=seconds)


def test_every_steps_saves_at_multiples_only() -> None:
    policy = SavePolicy(every_steps=5)

    saved = [step for step in range(1, 21) if due(policy, at(step), None)]

    assert saved == [5, 10, 15, 20]


def test_every_steps_waits_for_the_end_of_gradient_accumulation() -> None:
    policy = SavePolicy(every_steps=5)

    assert not due(policy, at(10, micro_step=1), None)
    assert not due(policy, at(10, micro_step=3), None)
    assert due(policy, at(10, micro_step=0), None)


def test_every_steps_never_saves_at_step_zero() -> None:
    assert not due(SavePolicy(every_steps=1), at(0), None)
    assert not due(SavePolicy(every_steps=5), at(0), None)


def test_never_twice_at_the_same_position() -> None:
    steps, both = SavePolicy(every_steps=5), SavePolicy(every_steps=5, every_seconds=1.0)

    assert not due(steps, at(10), at(10))
    assert not due(both, at(10), at(10), seconds=100.0)
    assert not due(both, at(3, 2), at(3, 2), seconds=100.0)


def test_every_steps_does_not_save_again_at_or_before_the_last_step() -> None:
    policy = SavePolicy(every_steps=5)

    assert not due(policy, at(10), at(10, micro_step=2))
    assert not due(policy, at(10), at(12))  # e.g. right after a resume from a later bundle
    assert due(policy, at(15), at(10))
    assert due(policy, at(10), at(9, micro_step=1))


def test_every_seconds_saves_once_the_time_has_passed() -> None:
    policy = SavePolicy(every_seconds=60.0)

    assert not due(policy, at(3), at(2), seconds=59.9)
    assert due(policy, at(3), at(2), seconds=60.0)
    assert due(policy, at(3, micro_step=1), None, seconds=61.0)
    assert due(policy, at(0), None, seconds=60.0)


def test_every_seconds_saves_a_step_once() -> None:
    policy = SavePolicy(every_seconds=60.0)

    assert not due(policy, at(3, micro_step=2), at(3), seconds=600.0)
    assert due(policy, at(4, micro_step=2), at(3), seconds=600.0)


def test_either_rule_triggers_a_save() -> None:
    policy = SavePolicy(every_steps=100, every_seconds=60.0)

    assert due(policy, at(100), at(50), seconds=1.0)
    assert due(policy, at(51), at(50), seconds=60.0)
    assert not due(policy, at(51), at(50), seconds=1.0)


def test_no_rule_never_saves() -> None:
    assert not due(SavePolicy(), at(100), None, seconds=1e9)


def test_counters_round_trip_through_json() -> None:
    counters = Counters(epoch=2, step=1000, micro_step=3, batch=17, samples=64_000, tokens=2**40)
    counters.extras = {"best_loss": 1.25, "tags": ["a", "b"], "nested": {"k": None, "flag": True}}

    state = json.loads(json.dumps(counters.to_state(), allow_nan=False))
    restored = Counters()
    restored.load_state(state)

    assert restored == counters
    assert restored.extras is not counters.extras


def test_to_state_is_a_copy() -> None:
    counters = Counters(extras={"seen": [1]})

    state = counters.to_state()
    state["extras"]["seen"].append(2)

    assert counters.extras == {"seen": [1]}


@pytest.mark.parametrize(
    "extra",
    [object(), {1, 2}, math.nan, math.inf, b"bytes", {(1, 2): "tuple key"}],
)
def test_non_json_extras_are_unrepresentable(extra: object) -> None:
    counters = Counters(extras={"value": extra})

    with pytest.raises(UnrepresentableStateError, match="counters/extras"):
        counters.to_state()


@pytest.mark.parametrize(
    "change",
    [
        lambda state: state.pop("tokens"),
        lambda state: state.update(unknown=1),
    ],
    ids=["missing", "unknown"],
)
def test_load_state_refuses_other_keys(change: Any) -> None:
    state = Counters().to_state()
    change(state)

    with pytest.raises(ValueError, match="counters state has keys"):
        Counters().load_state(state)


SHA = "0" * 64


def layer_record(sizes: list[int], payload_bytes: int) -> dict[str, Any]:
    return {
        "payload_bytes": payload_bytes,
        "header_bytes": 8,
        "blobs": [{"sha256": SHA, "size": size} for size in sizes],
        "tensors": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
    }


def manifest_data(
    *, world_size: int = 1, layers: dict[int, list[Layer]] | None = None, **fields: Any
) -> dict[str, Any]:
    layers = layers if layers is not None else {rank: list(Layer) for rank in range(world_size)}
    return {
        "run": "r",
        "step": 10,
        "world_size": world_size,
        "created_at": "2025-01-01T00:00:00Z",
        "versions": {"ckpt": "0.1.0", "python": "3.11", "torch": "2.4"},
        "ranks": [
            {"rank": rank, "layers": {layer.value: layer_record([8, 8], 16) for layer in present}}
            for rank, present in layers.items()
        ],
        **fields,
    }


def test_a_valid_manifest_round_trips_through_json() -> None:
    manifest = Manifest.model_validate(manifest_data(world_size=2))

    assert manifest.format == MANIFEST_FORMAT
    assert Manifest.model_validate_json(manifest.model_dump_json()) == manifest
    assert missing_parts(manifest) == []


@pytest.mark.parametrize("fmt", ["ckpt.bundle/2", "", "torch.save"])
def test_an_unknown_manifest_format_is_refused(fmt: str) -> None:
    with pytest.raises(ValidationError, match="unknown manifest format"):
        Manifest.model_validate(manifest_data(format=fmt))


@pytest.mark.parametrize(("sizes", "payload_bytes"), [([8, 8], 17), ([8], 16), ([], 8)])
def test_blob_sizes_must_sum_to_the_payload(sizes: list[int], payload_bytes: int) -> None:
    data = manifest_data()
    data["ranks"][0]["layers"]["weights"] = layer_record(sizes, payload_bytes)

    with pytest.raises(ValidationError, match="blobs hold"):
        Manifest.model_validate(data)


@pytest.mark.parametrize(
    "change",
    [
        {"step": -1},
        {"world_size": 0},
        {"surprise": 1},
        {"ranks": [{"rank": 0, "layers": {"gradients": layer_record([16], 16)}}]},
        {"ranks": [{"rank": 0, "layers": {"weights": {**layer_record([16], 16), "extra": 1}}}]},
        {
            "ranks": [
                {
                    "rank": 0,
                    "layers": {
                        "weights": layer_record([16], 16)
                        | {"blobs": [{"sha256": "XYZ", "size": 16}]}
                    },
                }
            ]
        },
    ],
    ids=[
        "negative-step",
        "no-ranks",
        "extra-field",
        "unknown-layer",
        "extra-layer-field",
        "bad-sha",
    ],
)
def test_malformed_manifests_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Manifest.model_validate(manifest_data() | change)


def test_missing_parts_lists_absent_ranks_and_layers_in_restore_order() -> None:
    manifest = Manifest.model_validate(
        manifest_data(world_size=3, layers={0: list(Layer), 2: [Layer.COUNTERS, Layer.WEIGHTS]})
    )

    assert missing_parts(manifest) == [
        (1, Layer.WEIGHTS),
        (1, Layer.OPTIMIZER),
        (1, Layer.SCHEDULER),
        (1, Layer.RNG),
        (1, Layer.DATA),
        (1, Layer.COUNTERS),
        (2, Layer.OPTIMIZER),
        (2, Layer.SCHEDULER),
        (2, Layer.RNG),
        (2, Layer.DATA),
    ]


def test_missing_parts_of_an_empty_bundle_is_everything() -> None:
    manifest = Manifest.model_validate(manifest_data(world_size=2, layers={}))

    assert len(missing_parts(manifest)) == 12
    assert missing_parts(manifest)[0] == (0, Layer.WEIGHTS)


@pytest.mark.parametrize(("name", "value"), [("step", 1.5), ("epoch", "3"), ("batch", True)])
def test_counters_must_be_ints(name: str, value: object) -> None:
    counters = Counters()
    setattr(counters, name, value)
    with pytest.raises(UnrepresentableStateError, match=f"counters/{name}"):
        counters.to_state()
    state = Counters().to_state()
    state[name] = value
    with pytest.raises(ValueError, match=name):
        Counters().load_state(state)


def test_counter_extras_need_string_keys() -> None:
    with pytest.raises(UnrepresentableStateError, match="strings"):
        Counters(extras={1: "a"}).to_state()  # type: ignore[dict-item]


@pytest.mark.parametrize("ranks", [(0, 0), (0, 2)])
def test_manifest_ranks_are_distinct_and_below_world_size(ranks: tuple[int, ...]) -> None:
    with pytest.raises(ValidationError, match="distinct and below world_size"):
        Manifest(
            run="r",
            step=1,
            world_size=2,
            created_at="now",
            versions=Versions(ckpt="0", python="3", torch="2"),
            ranks=tuple(RankRecord(rank=rank, layers={}) for rank in ranks),
        )
