"""Turn library results (frozen dataclasses, enums, paths, tuples) into JSON-ready data."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """Recursively convert dataclasses, enums, paths, sets and tuples into JSON-compatible values.

    Non-finite floats become None (JSON has no NaN/inf); unknown objects become their `str()`.
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(to_jsonable(v) for v in obj)
    return str(obj)
