"""Parse ``device_mapping`` values without eval.

Accepted forms (all give a list of distinct ints; that they are >= 0 is the range declared on
the ``device_mapping`` field, checked by the loader):

- a YAML list: ``[0, 1, 2, 3]``
- ranges and ids separated by commas: ``"0-7"``, ``"0-3,8-11"``, ``"4"``
- the Python-looking strings that alibaba/ROLL files use: ``"list(range(0,8))"``,
  ``"list(range(0, 16, 2))"``, ``"range(8)"`` and a literal list inside ``list(...)``:
  ``"list([0,1,2,3,8,9,10,11])"``, ``"[0, 1]"``; they are parsed by regular expressions, never evaluated.
"""

from __future__ import annotations

import re

from roll.configs.errors import ConfigError

_RANGE_CALL = re.compile(r"^\s*(?:list\(\s*)?range\(\s*([^()]*?)\s*\)(?:\s*\))?\s*$")
_LIST_LITERAL = re.compile(r"^\s*(?:list\(\s*)?\[([^\[\]()]*)\](?:\s*\))?\s*$")
_SPAN = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_HINT = "use a YAML list like [0, 1, 2, 3], a span like '0-3', or 'list(range(0,4))'"


def parse_device_mapping(value: object, path: str = "device_mapping") -> list[int] | None:
    """Turn any accepted ``device_mapping`` form into a list of distinct device ids (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(path, f"expected a list of device ids, got {value!r}; {_HINT}")
    if isinstance(value, int):
        ids = [value]
    elif isinstance(value, (list, tuple)):
        ids = [_as_int(v, f"{path}[{i}]") for i, v in enumerate(value)]
    elif isinstance(value, str):
        ids = _parse_string(value, path)
    else:
        raise ConfigError(path, f"expected a list of device ids, got {type(value).__name__}; {_HINT}")
    if not ids:
        raise ConfigError(path, f"is empty; {_HINT}")
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise ConfigError(path, f"device {i} is listed twice")
        seen.add(i)
    return ids


def format_device_ids(ids: list[int]) -> str:
    """Compact form for printing: [0,1,2,3,6] -> '0-3,6'."""
    if not ids:
        return "-"
    parts: list[str] = []
    start = prev = ids[0]
    for i in ids[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def _as_int(v: object, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(path, f"expected a device id (int), got {v!r}")
    if isinstance(v, str):
        if not v.strip().isdigit():
            raise ConfigError(path, f"expected a device id (int), got {v!r}")
        return int(v)
    return v


def _parse_string(text: str, path: str) -> list[int]:
    m = _RANGE_CALL.match(text)
    if m:
        return _parse_range_args(m.group(1), text, path)
    literal = _LIST_LITERAL.match(text)
    if literal:
        if text.strip().startswith("list") != text.strip().endswith(")"):
            raise ConfigError(path, f"cannot parse {text!r}: unbalanced parentheses; {_HINT}")
        items = [p.strip() for p in literal.group(1).split(",") if p.strip()]
        return [_as_int(item, f"{path}[{i}]") for i, item in enumerate(items)]
    ids: list[int] = []
    for part in text.split(","):
        span = _SPAN.match(part)
        if not span:
            raise ConfigError(path, f"cannot parse {text!r}; {_HINT}")
        lo = int(span.group(1))
        hi = int(span.group(2)) if span.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(path, f"span {part.strip()!r} runs backwards; write '{hi}-{lo}'")
        ids.extend(range(lo, hi + 1))
    return ids


def _parse_range_args(args: str, text: str, path: str) -> list[int]:
    pieces = [p.strip() for p in args.split(",")] if args.strip() else []
    if not 1 <= len(pieces) <= 3 or not all(re.fullmatch(r"-?\d+", p) for p in pieces):
        raise ConfigError(path, f"cannot parse {text!r}: range() takes 1 to 3 integer literals; {_HINT}")
    nums = [int(p) for p in pieces]
    if len(nums) == 3 and nums[2] == 0:
        raise ConfigError(path, f"cannot parse {text!r}: range() step must not be zero")
    return list(range(*nums))
