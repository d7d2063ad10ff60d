"""Keep rules: tensor name patterns, parts defined by name patterns and N tensors kept 16-bit per part.

``--part depth=groups.*,heads.*,in_proj --part backbone=layers.*,embed_tokens
--keep-most-sensitive backbone=2 --keep-most-sensitive depth=999`` is the rule
"the N most sensitive tensors of each part stay 16-bit" with N per part, the
form MLX kept-16-bit configs record in their ``scan`` block.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping, Sequence

from mlx_dq.errors import InputError
from mlx_dq.names import split_layer


def parse_parts(values: Sequence[str]) -> dict[str, list[str]] | None:
    """``NAME=PATTERN[,PATTERN...]`` values -> part name -> patterns (None when no value: default parts)."""
    parts: dict[str, list[str]] = {}
    for v in values:
        name, sep, pats = v.partition("=")
        if not sep or not name.strip() or not pats.strip():
            raise InputError(f"--part expects NAME=PATTERN[,PATTERN...], got {v!r}")
        parts.setdefault(name.strip(), []).extend(p.strip() for p in pats.split(",") if p.strip())
    return parts or None


def parse_keep_counts(values: Sequence[str]) -> int | dict[str, int] | None:
    """``N`` (every part) or ``PART=N`` values -> the optimizer's ``keep_most_sensitive``."""
    if not values:
        return None
    counts: dict[str, int] = {}
    plain: int | None = None
    for v in values:
        name, sep, n = v.rpartition("=")
        try:
            k = int(n)
        except ValueError:
            raise InputError(f"--keep-most-sensitive expects N or PART=N, got {v!r}") from None
        if k < 0:
            raise InputError(f"--keep-most-sensitive: N must be >= 0, got {v!r}")
        if sep:
            counts[name.strip()] = k
        else:
            plain = k
    if counts and plain is not None:
        raise InputError("--keep-most-sensitive: give either one N for every part or PART=N values, not both")
    if plain is not None:
        return plain or None
    return counts


def check_parts(counts: int | dict[str, int] | None, parts: dict[str, list[str]] | None) -> None:
    """Every PART=N names a part that --part defines (when parts are defined)."""
    if isinstance(counts, dict) and parts is not None:
        unknown = sorted(set(counts) - set(parts))
        if unknown:
            raise InputError(f"--keep-most-sensitive names parts no --part defines: {', '.join(unknown)}")


def key_matches(key: str, patterns: Sequence[str]) -> bool:
    """Whether tensor ``key`` (or its parameter name, ``key.weight``) equals or glob-matches one of ``patterns``."""
    names = (key, key + ".weight")
    return any(n == p or fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def default_part(key: str) -> str:
    """The part of a tensor for the keep-most-sensitive rule.

    ``backbone`` for decoder layers (``...layers.N.``), else its first path component.
    """
    if (found := split_layer(key, containers=None)) is not None and found[2]:
        return "backbone"
    return key.split(".", 1)[0]


def part_of(key: str, parts: Mapping[str, Sequence[str]] | None) -> str | None:
    """The part ``key`` belongs to: the first of ``parts`` (name -> patterns) matching it, or
    :func:`default_part` when no parts are given; None when no given part matches."""
    if parts is None:
        return default_part(key)
    for name, pats in parts.items():
        if key_matches(key, pats):
            return name
    return None
