"""An independent reference for mesh groups: by coordinates, not by reshaping arrays."""

from __future__ import annotations


def coord(i: int, dims: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Row-major coordinates of position i in a mesh of shape `dims` (last axis fastest)."""
    out = []
    for d in reversed(dims):
        i, c = divmod(i, d)
        out.append(c)
    return tuple(reversed(out))


def groups_by_coordinates(
    order: list[int], dims: tuple[int, ...] | list[int]
) -> list[list[list[int]]]:
    """For each axis k, the groups: ranks at positions whose coordinates agree on every other
    axis, in increasing position (i.e. coordinate k ascending)."""
    out = []
    for k in range(len(dims)):
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for pos in range(len(order)):
            c = coord(pos, dims)
            by_rest.setdefault(c[:k] + c[k + 1 :], []).append(order[pos])
        out.append(list(by_rest.values()))
    return out
