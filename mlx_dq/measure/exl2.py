"""ExLlamaV2 measurements: its storage formula, the mapping of its options to MLX options and shape recovery.

ExLlamaV2 options map to MLX options as follows (an approximation, documented
here because the optimizer budgets with it). EXL2 stores 4-bit scales per group
(about 0.13 bpw of overhead at group 32) while MLX stores a 16-bit scale and a
16-bit bias per group (1.0 bpw at group 32, 0.25 at group 128). With
``exl2_map="storage"`` (default) every segment keeps its bit width (rounded to
the nearest MLX width, ties upward: 1 -> 2, 7 -> 8) and proportion, and takes
the MLX group size whose storage is nearest the EXL2 segment's storage, so the
MLX option costs about what the EXL2 option cost and its measured error is a
fair stand-in ("equal storage, similar error"). With ``exl2_map="layout"`` the
EXL2 group size is kept (same code layout, larger files). With ``exl2_map="uniform"``
a mixed EXL2 option becomes one whole-tensor MLX option at the width nearest its
proportion-weighted mean width (ties upward; group size as in "storage"), so a plan
from any EXL2 file can be stock-loadable (``--mlx-lm-compatible``); its measured
error is then only a stand-in. ``total_bits`` and
``bpw`` of an imported option are always MLX storage bits of the mapped option
(what the plan will really cost); the EXL2 figures stay in ``exl2_total_bits``,
``exl2_desc`` and ``exl2_qparams``. When several EXL2 options of one tensor map
to the same MLX option, the one whose EXL2 storage is nearest the MLX storage is
kept (ties: the larger error). ExLlamaV2 files carry no shapes: they are
recovered exactly from ``total_bits`` with ExLlamaV2's storage formula.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

from mlx_dq.errors import InputError
from mlx_dq.quant.options import VALID_BITS, VALID_GROUPS, QuantOption, Segment


def exl2_storage_bits(in_features: int, out_features: int, qparams: Mapping, perm_bits: int = 0) -> int:
    """Bits ExLlamaV2 counts for a linear with ``qparams`` (its ``total_bits``, no bias).

    EXL2 groups run along the input dimension (its rows): codes, ``scale_bits``
    per group and output column, 48 bits of per-group metadata and, in the
    current form (``perm_bits=32``), the input permutation.
    """
    rows, cols = int(in_features), int(out_features)
    groups, rem, per = 0, rows, []
    for b, p in zip(qparams["bits"], qparams["bits_prop"]):
        gs = int(qparams["group_size"][str(b)])
        g = math.ceil(min(rows * float(p), rem) / gs)
        groups += g
        rem -= g * gs
        per.append((g, gs, int(b)))
    total, left = 0, rows
    for g, gs, b in per:
        r = min(g * gs, left)
        left -= r
        total += r * cols * b
    return total + groups * cols * int(qparams["scale_bits"]) + groups * 48 + rows * perm_bits


def _exl2_bits_vec(rows: np.ndarray, cols: np.ndarray, qp: Mapping, perm_bits: int = 32) -> np.ndarray:
    """Vectorised :func:`exl2_storage_bits` over arrays of shapes (for shape recovery)."""
    rows = rows.astype(np.int64)
    cols = cols.astype(np.int64)
    groups = np.zeros_like(rows)
    rem = rows.copy()
    total = np.zeros(np.broadcast(rows, cols).shape, dtype=np.int64)
    left = rows.copy()
    for b, p in zip(qp["bits"], qp["bits_prop"]):
        gs = int(qp["group_size"][str(b)])
        g = np.ceil(np.minimum(rows * float(p), rem) / gs).astype(np.int64)
        groups = groups + g
        rem = rem - g * gs
        r = np.minimum(g * gs, left)
        left = left - r
        total = total + r * cols * int(b)
    return total + groups * cols * int(qp["scale_bits"]) + groups * 48 + rows * perm_bits


def _nearest_bits(b: int) -> int:
    return min(VALID_BITS, key=lambda v: (abs(v - b), -v))


def map_exl2_qparams(qparams: Mapping, in_features: int | None = None, mode: str = "storage") -> QuantOption:
    """The MLX option nearest an ExLlamaV2 ``qparams`` record (see the module notes).

    ``mode="storage"`` picks per segment the MLX group size whose storage is nearest
    EXL2's; ``"layout"`` keeps EXL2's group size; ``"uniform"`` maps a mixed option to one
    whole-tensor width (the proportion-weighted mean, nearest MLX width). Group sizes that
    do not divide ``in_features`` are skipped.
    """
    if mode not in ("storage", "layout", "uniform"):
        raise InputError(f"EXL2 mapping mode must be 'storage', 'layout' or 'uniform', got {mode!r}")
    try:
        bits = [int(b) for b in qparams["bits"]]
        props = [float(p) for p in qparams["bits_prop"]]
        gmap = {str(k): int(v) for k, v in qparams["group_size"].items()}
        sbits = int(qparams.get("scale_bits", 4))
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"malformed ExLlamaV2 qparams {qparams!r}: {e}") from None
    if bits == [16]:
        return QuantOption.fp16()
    if mode == "uniform" and len(bits) > 1:
        mean = sum(b * p for b, p in zip(bits, props)) / sum(props)
        wide = max(bits, key=lambda b: (props[bits.index(b)], b))  # the group size of the largest share
        return map_exl2_qparams({"bits": [int(math.floor(mean + 0.5))], "bits_prop": [1.0],
                                 "group_size": {str(int(math.floor(mean + 0.5))): gmap.get(str(wide), 64)},
                                 "scale_bits": sbits}, in_features, "storage")
    segs: dict[int, list[float]] = {}
    for b, p in zip(bits, props):
        g_exl2 = gmap.get(str(b), 64)
        mb = _nearest_bits(b)
        groups = [g for g in VALID_GROUPS if in_features is None or in_features % g == 0] or [32]
        if mode == "layout":
            g = min(groups, key=lambda v: (abs(v - g_exl2), v))
        else:
            overhead = sbits / g_exl2
            g = min(groups, key=lambda v: (abs(32.0 / v - overhead), -v))
        if mb in segs:
            segs[mb][0] += p
        else:
            segs[mb] = [p, g]
    seg_list = [Segment(b, int(g), p) for b, (p, g) in sorted(segs.items(), key=lambda kv: -kv[0])]
    total = sum(s.prop for s in seg_list)
    seg_list = [Segment(s.bits, s.group_size, s.prop / total) for s in seg_list]
    opt = QuantOption(tuple(seg_list))
    if in_features is not None and not opt.fits(in_features):
        opt = QuantOption(tuple(Segment(s.bits, 32, s.prop) for s in seg_list))
    return opt


def exl2_description(qp: Mapping) -> str:
    """ExLlamaV2's description of a ``qparams`` record, e.g. ``0.1:4b_32g/0.9:3b_32g s4``."""
    parts = [f"{float(p):g}:{int(b)}b_{int(qp['group_size'][str(b)])}g" for b, p in zip(qp["bits"], qp["bits_prop"])]
    return "/".join(parts) + f" s{int(qp.get('scale_bits', 4))}"


def dedupe_mapped(records: list, mlx_bits: Callable, exl2_bits: Callable, err: Callable, key: Callable) -> list:
    """Keep one record per mapped MLX option: nearest EXL2 storage, then larger error."""
    best: dict = {}
    order: list = []
    for r in records:
        k = key(r)
        score = (abs(exl2_bits(r) - mlx_bits(r)), -err(r))
        if k not in best:
            order.append(k)
            best[k] = (score, r)
        elif score < best[k][0]:
            best[k] = (score, r)
    return [best[k][1] for k in order]


# --------------------------------------------------------------------------- shape recovery
def _divisor_shapes(numel: int) -> list[tuple[int, int]]:
    out = []
    for d in range(1, math.isqrt(numel) + 1):
        if numel % d == 0:
            out += [(d, numel // d), (numel // d, d)]
    return out


def recover_shape(key: str, numel: int, options: Sequence[Mapping], path: str) -> tuple[int, int]:
    """[out, in] of an EXL2 linear whose ``total_bits`` all match ExLlamaV2's formula."""
    for rows, cols in _divisor_shapes(numel):
        if rows % 32:
            continue
        if all(exl2_storage_bits(rows, cols, o["qparams"]) == round(float(o["total_bits"])) for o in options):
            return (cols, rows)
    raise InputError(f"{path}: cannot recover the shape of {key!r} (numel {numel}) from its total_bits")


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def joint_bits_match(shapes: Mapping[str, tuple], options: Sequence[Mapping]) -> bool:
    """Whether member shapes ([out, in]) reproduce every joint option's total_bits (current EXL2 form)."""
    return all(
        sum(exl2_storage_bits(shapes[k][1], shapes[k][0], o[k], 32) for k in shapes) == round(float(o["total_bits"]))
        for o in options
    )


def recover_joint_shapes(module: str, options: Sequence[Mapping], hidden: int | None, path: str) -> dict[str, tuple]:
    """[out, in] of every member of a jointly measured llama-style module, from total_bits."""
    members = [k for k in options[0] if isinstance(options[0][k], dict)]
    first = options[0]
    step = 32
    hs = np.array([hidden]) if hidden else np.arange(step, 16384 + 1, step)

    def check(shapes: dict[str, tuple[int, int]]) -> bool:
        return joint_bits_match(shapes, options)

    if sorted(members) == sorted(_ATTN):
        h = hs[:, None, None]
        qo = np.arange(step, 4 * 16384 + 1, step)
        if hidden:
            q = np.arange(step, 4 * hidden + 1, step)[None, :, None]
            kv = np.arange(step, 4 * hidden + 1, step)[None, None, :]
        else:
            q = qo[None, :, None][:, :256]
            kv = qo[None, None, :][:, :, :256]
        tot = (
            _exl2_bits_vec(h, q, first["q_proj"]) + _exl2_bits_vec(h, kv, first["k_proj"])
            + _exl2_bits_vec(h, kv, first["v_proj"]) + _exl2_bits_vec(q, h, first["o_proj"])
        )
        for i, j, k in zip(*np.nonzero(tot == round(float(first["total_bits"])))):
            H, Q, KV = int(hs[i]), int(q.ravel()[j]), int(kv.ravel()[k])
            shapes = {"q_proj": (Q, H), "k_proj": (KV, H), "v_proj": (KV, H), "o_proj": (H, Q)}
            if check(shapes):
                return shapes
    elif sorted(members) == sorted(_MLP):
        h = hs[:, None]
        inter = np.arange(step, 65536 + 1, step)[None, :]
        tot = (
            _exl2_bits_vec(h, inter, first["gate_proj"]) + _exl2_bits_vec(h, inter, first["up_proj"])
            + _exl2_bits_vec(inter, h, first["down_proj"])
        )
        for i, j in zip(*np.nonzero(tot == round(float(first["total_bits"])))):
            H, I = int(hs[i]), int(inter.ravel()[j])
            shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
            if check(shapes):
                return shapes
    raise InputError(
        f"{path}: cannot recover the shapes of the members {members} of {module!r} from total_bits; "
        "pass shapes={key: [out, in], ...} to load_measurement"
    )
