"""Fields of a prompt row that name media files (a row's videos, its audios)."""

from __future__ import annotations

from typing import Any


def row_files(row: dict[str, Any], field: str, what: str) -> list[str] | None:
    """The file names in ``row[field]`` (one name or a list), None when it has none; ValueError
    naming ``field`` for a value of the wrong shape (``what``: "a video path", "an audio file name")."""
    names = row.get(field)
    if names is None:
        return None
    names = names if isinstance(names, list) else [names]
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"wrong type: {field} must be {what} or a list of them")
    return names or None
