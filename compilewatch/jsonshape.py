"""Frozen dataclasses from untrusted JSON, every field checked against its annotation.

`Cls(**data)` accepts anything: a lock whose `python` is a string fails with "argument after ** must
be a mapping", one whose GPU memory is a string fails later, inside a diff. `build(Cls, data, where)`
checks each value against the field's type first and raises one BadInput naming the field
(`old.lock.json: gpus[1].memory_bytes: expected an integer, got "80GB"`).

Types understood: dataclasses (nested), `X | None`, `str`, `int` (not bool), `float` (an int is
accepted), `bool`, `tuple[X, ...]` (from a JSON list), `dict[str, X]`, `Any`. Keys the class does
not have are ignored (files from a newer writer); a missing field without a default is an error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, TypeVar

from compilewatch.errors import BadInput
from compilewatch.inputs import one_line

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fail(where: str, path: str, what: str, value: Any) -> BadInput:
    shown = one_line(repr(value), 60)
    return BadInput(f"{where}: {path or 'the top level'}: expected {what}, got {shown}")


def build(cls: type[T], data: Any, where: str, path: str = "") -> T:
    """An instance of dataclass `cls` from `data` (a JSON object), or BadInput naming the bad field."""
    if not isinstance(data, dict):
        raise _fail(where, path, f"an object ({cls.__name__})", data)
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        sub = f"{path}.{f.name}" if path else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BadInput(f"{where}: missing the field {sub!r}")
            continue
        kwargs[f.name] = _value(hints[f.name], data[f.name], where, sub)
    return cls(**kwargs)


def _value(tp: Any, v: Any, where: str, path: str) -> Any:
    if tp is Any:
        return v
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _value(rest[0], v, where, path)
        for a in rest:
            try:
                return _value(a, v, where, path)
            except BadInput:
                continue
        raise _fail(where, path, " or ".join(getattr(a, "__name__", str(a)) for a in rest), v)
    if dataclasses.is_dataclass(tp):
        return build(tp, v, where, path)
    if tp is str:
        if not isinstance(v, str):
            raise _fail(where, path, "a string", v)
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise _fail(where, path, "true or false", v)
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _fail(where, path, "an integer", v)
        return v
    if tp is float:
        try:  # an int past float's range (JSON holds ints of any size) is no number here either
            f = None if isinstance(v, bool) or not isinstance(v, (int, float)) else float(v)
        except OverflowError:
            f = None
        if f is None or not math.isfinite(f):
            raise _fail(where, path, "a finite number", v)
        return f
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise _fail(where, path, "a list", v)
        args = typing.get_args(tp)
        item = args[0] if args else Any
        return tuple(_value(item, x, where, f"{path}[{i}]") for i, x in enumerate(v))
    if origin is dict:
        if not isinstance(v, dict):
            raise _fail(where, path, "an object", v)
        _k, item = typing.get_args(tp) or (str, Any)
        return {str(k): _value(item, x, where, f"{path}.{k}") for k, x in v.items()}
    if origin is list:
        if not isinstance(v, list):
            raise _fail(where, path, "a list", v)
        (item,) = typing.get_args(tp) or (Any,)
        return [_value(item, x, where, f"{path}[{i}]") for i, x in enumerate(v)]
    return v  # a type this module does not know: taken as is
