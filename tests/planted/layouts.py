"""Planted bugs in the layout checks: stricter checks that refuse valid layouts because of
a size-1 dimension's stride. Each is an edit of layout.py (old text, new text, which must
match once) and the valid layout it must be caught refusing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StrictStrideBug:
    name: str
    edit: tuple[str, str]
    caught_as: str


STRICT_STRIDE_BUGS = (
    StrictStrideBug(
        "inner dims must have packed strides, size 1 too",
        ("if any(n > 1 and s != p for n, s, p in", "if any(s != p for n, s, p in"),
        "a size-1 last dim from transpose: refused",
    ),
    StrictStrideBug(
        "a single block must not overlap itself",
        ("if shape[dim] > 1 and stride < nbytes:", "if stride < nbytes:"),
        "one block, stride 0: refused",
    ),
    StrictStrideBug(
        "outer dims of size 1 must not have stride 0",
        ("if any(n > 1 and s == 0 for n, s in", "if any(s == 0 for n, s in"),
        "a size-1 outer dim, stride 0: refused",
    ),
)
