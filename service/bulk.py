"""Request bodies with long lists, parsed off the event loop and in slices.

FastAPI parses and validates a body on the event loop, in one call that holds the GIL: for
10,000 blob references that is 15-80 ms during which no other request, ``/healthz``
included, is answered. ``parse_body`` does the same work on a worker thread, a slice of
``SLICE`` items per call, so that the event loop waits for the GIL at most one slice long.
Its errors are FastAPI's own (``RequestValidationError``, answered 422 by the one handler).
Between slices, a bulk request steps aside for priority requests in flight
(``service.yielding``), and ``rendered`` serializes its answer on the worker thread too.
"""

from __future__ import annotations

import functools
import json
from typing import Any, TypeVar, get_args

from annotated_types import MaxLen
from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

from service.yielding import step_aside

SLICE = 100  # items per validation call: about 0.3 ms each (500 took 1-1.5 ms under load)
M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``, parsed and validated on a worker thread."""
    return await run_in_threadpool(parse_json, await request.body(), model)


def parse_json(body: bytes, model: type[M]) -> M:
    """``model`` from a JSON ``body``, validating its long lists a slice at a time."""
    data = _loads(body)
    if isinstance(data, dict):
        for name, value in data.items():
            if name in model.model_fields and isinstance(value, list) and len(value) > SLICE:
                data[name] = _items(model, name, value)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(_located(err.errors(), ("body",)), body=data) from err


def rendered(model: BaseModel) -> Response:
    """``model`` as the JSON answer FastAPI would send, serialized here, on the worker thread,
    after a pause for a priority request in flight (``service.yielding``): FastAPI would
    serialize it on the event loop, which no other request passes meanwhile (1 ms for an
    answer of 10,000 blobs). A route that returns it names its ``response_model``."""
    step_aside()
    return Response(model.model_dump_json(by_alias=True), media_type="application/json")


def with_json(model: BaseModel, **fields: str) -> str:
    """``model``'s JSON with ``fields`` set to JSON texts as they are (not parsed and written
    out again: ``runs.service.resume_json``)."""
    text = model.model_dump_json(exclude=set(fields))
    added = ",".join(f"{json.dumps(name)}:{value}" for name, value in fields.items())
    return f"{text[:-1]}{',' if text != '{}' else ''}{added}}}"


def json_answer(text: str, *, status_code: int = 200) -> Response:
    """A JSON answer already written (a route that returns it names its ``response_model``)."""
    return Response(text, status_code=status_code, media_type="application/json")


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` that documents ``model`` as a route's JSON body (the route reads
    its body itself, so FastAPI does not know it). Models it refers to must be in the API's
    components already (used by another route)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def _loads(body: bytes) -> Any:
    if not body:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        # Through a Python hook at each object: the parse, 3-4 ms for 10,000 blobs in one C
        # call, then lets go of the GIL when another thread asks, and steps aside for a
        # priority request in flight (service.yielding); 0.7 ms more.
        return json.loads(body, object_hook=_aside)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise not_json(err) from None


def _aside(value: dict[str, Any]) -> dict[str, Any]:
    step_aside()
    return value


def not_json(err: ValueError | RecursionError) -> RequestValidationError:
    """The 422 for a body that is not JSON: a syntax error, bytes that are not UTF-8, or
    nesting deeper than the parser goes."""
    if isinstance(err, RecursionError):
        reason = "nested too deeply"
    else:
        reason = getattr(err, "msg", None) or str(err)
    return RequestValidationError(
        [
            {
                "type": "json_invalid",
                "loc": ("body", err.pos) if isinstance(err, json.JSONDecodeError) else ("body",),
                "msg": f"JSON decode error: {reason}",
                "input": {},
                "ctx": {"error": reason},
            }
        ]
    )


def _items(model: type[BaseModel], name: str, values: list[Any]) -> list[Any]:
    """The items of the list field ``name``, validated a slice at a time (not past the
    field's ``max_length``: a list too long is refused before any item is validated)."""
    field = model.model_fields[name]
    limit = min((m.max_length for m in field.metadata if isinstance(m, MaxLen)), default=None)
    if limit is not None and len(values) > limit:
        raise RequestValidationError(
            [
                {
                    "type": "too_long",
                    "loc": ("body", name),
                    "msg": f"List should have at most {limit} items, not {len(values)}",
                    "input": None,
                }
            ]
        )
    (item,) = get_args(field.annotation) or (Any,)
    adapter = _list_of(item)
    validated: list[Any] = []
    for start in range(0, len(values), SLICE):
        step_aside()  # for a priority request in flight (service.yielding)
        try:
            validated += adapter.validate_python(values[start : start + SLICE])
        except ValidationError as err:
            errors = [_shifted(error, start) for error in err.errors()]
            raise RequestValidationError(_located(errors, ("body", name))) from err
    return validated


@functools.cache
def _list_of(item: Any) -> TypeAdapter[list[Any]]:
    return TypeAdapter(list[item])


def _shifted(error: Any, start: int) -> dict[str, Any]:
    """A slice's error, located in the whole list."""
    index, *rest = error["loc"]
    return {**error, "loc": (index + start, *rest)}


def _located(errors: Any, prefix: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{**error, "loc": (*prefix, *error["loc"])} for error in errors]
