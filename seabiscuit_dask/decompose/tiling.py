"""Regions of tensors, and tensors that exist only as tiles.

A *virtual* tensor is described by entries ``(region, leaf, leaf_region)``: the part
``region`` of the tensor is ``leaf[leaf_region]``, where ``leaf`` is a tensor some op
produces. Cutting a virtual tensor only narrows its entries; ops are emitted (a
slice of a leaf, a concatenation of slices) when a micro-op finally reads it.
"""

from __future__ import annotations

from ..ir import Region

Entry = tuple[Region, str, Region]
"""``(region of the tensor, produced tensor, region of that tensor holding it)``."""


def full(shape: tuple[int, ...]) -> Region:
    """The region covering all of ``shape``."""
    return tuple((0, n) for n in shape)


def extent(region: Region) -> tuple[int, ...]:
    """The shape of ``region``."""
    return tuple(b - a for a, b in region)


def replace(region: Region, dim: int, lo: int, hi: int) -> Region:
    """``region`` with ``[lo, hi)`` along ``dim``."""
    return (*region[:dim], (lo, hi), *region[dim + 1:])


def window(entries: tuple[Entry, ...], dim: int, a: int, b: int) -> tuple[Entry, ...]:
    """The entries of ``tensor[..., a:b, ...]`` (along ``dim``), in its own coordinates."""
    out: list[Entry] = []
    for region, leaf, src in entries:
        lo, hi = region[dim]
        top, bottom = max(lo, a), min(hi, b)
        if top >= bottom:
            continue
        s0 = src[dim][0]
        out.append((replace(region, dim, top - a, bottom - a), leaf,
                    replace(src, dim, s0 + top - lo, s0 + bottom - lo)))
    return tuple(out)


def shifted(entries: tuple[Entry, ...], dim: int, offset: int) -> tuple[Entry, ...]:
    """``entries`` moved by ``offset`` along ``dim`` (a tile placed inside a larger tensor)."""
    return tuple((replace(r, dim, r[dim][0] + offset, r[dim][1] + offset), leaf, src)
                 for r, leaf, src in entries)


def tag(region: Region) -> str:
    """A short name for ``region``: ``[0:4,8:16]``."""
    return "[" + ",".join(f"{a}:{b}" for a, b in region) + "]"


def concat_dim(regions: list[Region]) -> int | None:
    """The one dim along which ``regions`` differ, when they line up as a concatenation."""
    dims = {d for r in regions for d in range(len(r)) if r[d] != regions[0][d]}
    if len(dims) != 1:
        return None
    d = dims.pop()
    spans = sorted(r[d] for r in regions)
    return d if all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)) else None
