"""Layer selection: which of a model's FFNs a conversion replaces (the --layers spec)."""
from __future__ import annotations

import re

from moecompile.core.errors import MoECompileError


def parse_layers(spec, count: int) -> list[int]:
    """Layer selection: None/"all", "even", "odd", or indices and ranges like "0,2,5-7" (negative from the end)."""
    if spec is None or spec == "all":
        return list(range(count))

    def index(i: int) -> int:  # negative from the end, checked
        j = i + count if i < 0 else i
        if not 0 <= j < count:
            raise MoECompileError(f"layer {i} out of range: the model has {count} FFN layers")
        return j

    if isinstance(spec, (list, tuple)):
        items = [index(int(i)) for i in spec]
    elif spec in ("even", "odd"):
        return list(range(0 if spec == "even" else 1, count, 2))
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            m = re.fullmatch(r"(-?\d+)(?:-(-?\d+))?", part)
            if not m:
                raise MoECompileError(f"bad --layers spec {spec!r}: use 'all', 'even', 'odd' or e.g. '0,2,5-7'")
            lo = index(int(m.group(1)))  # resolve negative ends before expanding the range ("-3--1", "2--1")
            hi = index(int(m.group(2))) if m.group(2) is not None else lo
            if hi < lo:
                raise MoECompileError(f"bad --layers spec {spec!r}: range {part!r} is empty (start after end)")
            items.extend(range(lo, hi + 1))
    return sorted(set(items))
