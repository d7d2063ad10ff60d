"""Several MLX processes sharing one measurement or conversion (``mlx.launch``, ``mx.distributed``).

Started by ``mlx.launch`` (ring backend over Ethernet/Thunderbolt, or MPI), every
rank runs the same ``mlx_dq measure`` / ``mlx_dq convert`` command, as mlx-lm's
own AWQ and DWQ do: each rank streams the same layers from its own copy of the
weights, and

- the calibration rows are split across ranks in whole batches
  (:class:`RowShare`); the Gram statistics of each layer's inputs are summed
  with ``mx.distributed.all_sum``;
- the per-tensor x per-option work (and conversion's per-tensor work) is
  divided among ranks balanced by its estimated cost (:func:`split_by_cost`),
  and the results are gathered on every rank (:func:`gather_objects`);
- only rank 0 writes files (:func:`is_root`), except each rank's own resume
  state (its rows' hidden states).

A single process (no launcher) gets a group of size 1 and every helper here
is then a no-op, so that path is exactly the undistributed one.

Failure: a rank that raises exits with an error naming it (:func:`tag`);
``mlx.launch`` then stops the other ranks. Measurement files and resume
states are written atomically and a layer counts as done only once every
rank has saved its state for it, so an interrupted job resumes from its last
complete layer when the same command (same number of ranks) is run again.
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from mlx_dq.errors import InputError

_GROUP: Any = None
_INIT = False


def iter_batches(n: int, batch: int) -> Iterator[slice]:
    """Consecutive slices of ``range(n)`` of at most ``batch`` items (the row batches ranks share out)."""
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    for s in range(0, n, batch):
        yield slice(s, min(n, s + batch))


@dataclass
class Traffic:
    """Bytes this rank contributed to collective operations, by kind (for benchmarks)."""

    gram_bytes: int = 0
    object_bytes: int = 0
    calls: int = 0
    by_layer: dict = field(default_factory=dict)
    wait_s: dict = field(default_factory=dict)  # stage -> seconds spent inside collectives (waiting for peers)

    def waited(self, seconds: float, layer: Any = None) -> None:
        """Add ``seconds`` spent in a collective (mostly waiting for the slowest rank) under ``layer``."""
        key = "other" if layer is None else layer
        self.wait_s[key] = self.wait_s.get(key, 0.0) + seconds

    def add(self, kind: str, nbytes: int, layer: Any = None) -> None:
        """Count ``nbytes`` sent to one collective of ``kind`` ("gram" or "object")."""
        if kind == "gram":
            self.gram_bytes += nbytes
        else:
            self.object_bytes += nbytes
        self.calls += 1
        if layer is not None:
            per = self.by_layer.setdefault(layer, {"gram": 0, "object": 0})
            per["gram" if kind == "gram" else "object"] += nbytes


TRAFFIC = Traffic()
_LAYER: list = [None]  # the layer (or stage) collectives are counted under


def group() -> Any:
    """The distributed group (``mx.distributed.init()``, cached): size 1 without a launcher."""
    global _GROUP, _INIT
    if not _INIT:
        _INIT = True
        try:
            _GROUP = mx.distributed.init() if mx.distributed.is_available() else None
        except RuntimeError:  # pragma: no cover - no backend could start
            _GROUP = None
    return _GROUP


def size() -> int:
    """Number of ranks (1 without a launcher)."""
    g = group()
    return 1 if g is None else int(g.size())


def rank() -> int:
    """This process's rank (0 without a launcher)."""
    g = group()
    return 0 if g is None else int(g.rank())


def active() -> bool:
    """True when more than one rank takes part."""
    return size() > 1


def is_root() -> bool:
    """True on the rank that writes files (rank 0)."""
    return rank() == 0


def tag(message: str) -> str:
    """``message`` prefixed with this rank when distributed, so a failing rank is named."""
    return f"rank {rank()} of {size()}: {message}" if active() else message


def set_stage(layer: Any) -> None:
    """Count the following collectives' bytes under ``layer`` (see :data:`TRAFFIC`)."""
    _LAYER[0] = layer


# --------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------
def all_sum(x: mx.array) -> mx.array:
    """Sum of ``x`` over all ranks (``mx.distributed.all_sum`` on the CPU stream); ``x`` when alone."""
    if not active():
        return x
    TRAFFIC.add("gram", int(x.nbytes), _LAYER[0])
    mx.eval(x)
    t0 = time.perf_counter()
    y = mx.distributed.all_sum(x, group=group(), stream=mx.cpu)
    mx.eval(y)
    TRAFFIC.waited(time.perf_counter() - t0, _LAYER[0])
    return y


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (anything picklable, mx arrays included), in rank order, on every rank."""
    if not active():
        return [obj]
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    g = group()
    t0 = time.perf_counter()
    n = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int64), group=g, stream=mx.cpu)
    lengths = [int(v) for v in np.array(n)]
    TRAFFIC.waited(time.perf_counter() - t0, _LAYER[0])
    buf = np.zeros(max(lengths), dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    TRAFFIC.add("object", int(buf.nbytes), _LAYER[0])
    every = np.array(mx.distributed.all_gather(mx.array(buf), group=g, stream=mx.cpu)).reshape(size(), -1)
    return [pickle.loads(every[r, : lengths[r]].tobytes()) for r in range(size())]


def broadcast(obj: Any, root: int = 0) -> Any:
    """Rank ``root``'s ``obj`` on every rank (the others pass anything, e.g. None)."""
    if not active():
        return obj
    return gather_objects(obj if rank() == root else None)[root]


def barrier() -> None:
    """Wait until every rank gets here."""
    if active():
        t0 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group(), stream=mx.cpu))
        TRAFFIC.waited(time.perf_counter() - t0, _LAYER[0])


# --------------------------------------------------------------------------
# dividing work
# --------------------------------------------------------------------------
def split_by_cost(costs: Sequence[float], n: int | None = None, start: Sequence[float] | None = None) -> list[int]:
    """The rank that does each item: longest first, each to the least loaded rank (deterministic); ``start``: each
    rank's load before the items (work it has anyway, in the costs' units)."""
    n = size() if n is None else n
    load = [float(x) for x in start] if start is not None else [0.0] * n
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += float(costs[i])
    return owner


def option_cost(shape: Sequence[int], method: str, clip: bool, keep16: bool = False) -> float:
    """Rough cost of quantizing and measuring one option of a ``shape`` tensor (arbitrary units)."""
    numel = float(math.prod(int(d) for d in shape))
    if keep16:
        return numel
    in_f = float(shape[-1])
    cost = numel * (in_f if method == "gptq" else 16.0)
    return cost * (3.0 if clip else 1.0) + numel * in_f  # + the error against the Gram matrix


class RowShare:
    """Which calibration batches this rank runs: its own block of batches, plus those holding ``keep`` rows.

    The rows ``[:keep]`` (measurement's importance rows) are needed on every
    rank; their batches only count towards the Gram statistics on their owner.
    With one rank every batch is owned and nothing changes.
    """

    def __init__(self, n_rows: int, batch_size: int, keep: int = 0):

        self.batches = list(iter_batches(n_rows, batch_size))
        n, r = size(), rank()
        if n > 1 and len(self.batches) < n:
            raise InputError(
                f"{n} ranks need at least {n} batches of calibration rows: {n_rows} rows in batches of "
                f"{batch_size} give {len(self.batches)}; use more rows"
            )
        per = [len(self.batches) // n + (1 if k < len(self.batches) % n else 0) for k in range(n)]
        start = sum(per[:r])
        self.owned = set(range(start, start + per[r]))
        self.runs_set = set(self.owned) | {b for b, sl in enumerate(self.batches) if sl.start < keep}
        self.keep = keep

    def runs(self, b: int) -> bool:
        """True when this rank computes batch ``b``."""
        return b in self.runs_set

    def owns(self, b: int) -> bool:
        """True when batch ``b``'s statistics are this rank's to contribute."""
        return b in self.owned

    def owns_row(self, row: int) -> bool:
        """True when calibration row ``row`` belongs to one of this rank's batches."""
        return any(sl.start <= row < sl.stop for b, sl in enumerate(self.batches) if b in self.owned)

    def flush(self, collector: Any, b: int, owned: bool | None = None) -> None:
        """Fold batch ``b``'s recorded inputs into ``collector`` if owned (``owned`` overrides), else drop them.

        With several ranks each owned batch's Gram matrices are kept apart, so
        that :func:`reduce_stats` can add them in the one-process order.
        """
        owned = self.owns(b) if owned is None else owned
        if not active():
            collector.flush()
        elif not owned:
            collector._pending.clear()
            collector._pending_out.clear()
        else:
            prev = {k: st.gram for k, st in collector._groups.items()}
            prev_energies = dict(collector.energies)
            for st in collector._groups.values():
                st.gram = None
            collector.energies.clear()
            collector.flush()
            kept = collector.__dict__.setdefault("_batch_grams", [])
            kept.append({k: st.gram for k, st in collector._groups.items() if st.gram is not None})
            collector.__dict__.setdefault("_batch_energies", []).append(dict(collector.energies))
            for k, st in collector._groups.items():
                st.gram = prev.get(k)
            collector.energies.clear()
            collector.energies.update(prev_energies)

    def join(self, parts: list[mx.array]) -> Any:
        """The outputs of the batches run (in order) as one array (one rank) or a :class:`LocalRows`."""
        if not active():
            return mx.concatenate(parts, axis=0)
        run = [b for b in range(len(self.batches)) if self.runs(b)]
        return LocalRows(dict(zip(run, parts)), self.batches)

    def join_owned(self, parts: dict[int, mx.array]) -> Any:
        """Like :meth:`join`, from the outputs of this rank's own batches ``parts`` (batch -> array): the batches
        holding ``keep`` rows that another rank owns are received from it, not computed twice.

        Why: every rank needs those rows, and with two ranks computing them on both made one rank run one batch
        in five more than the other in every layer's forward. The bytes received are the owner's, so the result
        is the same as computing them here."""
        if not active():
            return mx.concatenate([parts[b] for b in sorted(parts)], axis=0)
        kept = [b for b, sl in enumerate(self.batches) if sl.start < self.keep]
        if kept:
            for part in gather_objects({b: parts[b] for b in kept if b in parts}):
                for b, v in part.items():
                    parts.setdefault(b, v)
        return LocalRows({b: parts[b] for b in sorted(parts) if self.runs(b)}, self.batches)


class LocalRows:
    """Hidden states of some calibration batches, read with the same slices as the full array.

    ``rows[sl]`` for a batch's slice returns that batch; ``rows[:n]`` the first
    ``n`` rows (their batches must be held).
    """

    def __init__(self, parts: dict[int, mx.array], batches: list[slice]):
        self.parts, self.batches = parts, batches

    def __getitem__(self, sl: slice) -> mx.array:
        for b, s in enumerate(self.batches):
            if s.start == (sl.start or 0) and s.stop == sl.stop and b in self.parts:
                return self.parts[b]
        start, stop = sl.start or 0, sl.stop
        held = [b for b, s in enumerate(self.batches) if s.start < stop and s.stop > start]
        missing = [b for b in held if b not in self.parts]
        if missing:
            raise KeyError(f"rows {start}:{stop} are not held on rank {rank()} (batches {missing})")
        whole = mx.concatenate([self.parts[b] for b in held], axis=0)
        return whole[start - self.batches[held[0]].start: stop - self.batches[held[0]].start]

    def arrays(self) -> dict[str, mx.array]:
        """The held batches by name ``hidden.<batch>`` (for a resume state file)."""
        return {f"hidden.{b}": v for b, v in self.parts.items()}


# --------------------------------------------------------------------------
# Gram statistics
# --------------------------------------------------------------------------
def _fold_in_order(own: list[mx.array]) -> mx.array:
    """The sum over every rank's per-batch arrays ``own``, added in the order one process adds them."""
    if not own:
        raise RuntimeError(tag("a watched module received no input rows on this rank"))
    acc = None
    for r in range(size()):
        if r == rank():
            for g in own:
                acc = g if acc is None else acc + g
            part = acc
        else:
            part = mx.zeros(own[0].shape, dtype=own[0].dtype)
        acc = all_sum(part)
    return acc


def reduce_stats(collector: Any) -> None:
    """Sum a :class:`~mlx_dq.model.capture.GramCollector`'s statistics over all ranks (in place), exactly.

    Float addition depends on its order, and GPTQ turns a last-bit change of
    the Gram matrix into different codes, so the Gram matrices are added in
    the order one process adds them: rank 0 folds its batches, its running sum
    reaches every rank through ``all_sum`` (the others add zeros), rank 1 folds
    its batches onto it, and so on. Each rank's per-batch Grams are computed in
    parallel; only the additions are in sequence. Row counts, per-expert row
    counts and token counts (integers) are gathered and added.
    """
    if not active():
        return
    groups = sorted(collector._groups.items())
    mine = collector.__dict__.pop("_batch_grams", [])
    for key, st in groups:
        st.gram = _fold_in_order([g[key] for g in mine if key in g])
    energies = collector.__dict__.pop("_batch_energies", [])
    for path in sorted({p for e in energies for p in e}):  # the same linear layers on every rank
        collector.energies[path] = _fold_in_order([e[path] for e in energies if path in e])
    small = [(st.rows, st.expert_rows) for _, st in groups]
    looks = sorted(collector.lookups.items())
    small_look = [(st.rows, st.token_counts) for _, st in looks]
    every = gather_objects((small, small_look))
    for j, (_, st) in enumerate(groups):
        st.rows = sum(e[0][j][0] for e in every)
        if st.expert_rows is not None:
            st.expert_rows = sum(e[0][j][1] for e in every)
    for j, (_, st) in enumerate(looks):
        st.rows = sum(e[1][j][0] for e in every)
        st.token_counts = sum(e[1][j][1] for e in every)


# --------------------------------------------------------------------------
# measurement records
# --------------------------------------------------------------------------
def merge_records(parts: Iterable[Any], order: Sequence[str]) -> Any:
    """One :class:`~mlx_dq.measure.records.TensorRecord` from several ranks' partial records of one tensor.

    Options are put in ``order`` (their descriptions); extra fields that list
    one value per option (e.g. ``lookup_damage``) are reordered with them.
    The first part's other fields are kept.
    """
    parts = [p for p in parts if p is not None]
    base = parts[0]
    by_desc: dict[str, tuple] = {}
    per_option_keys = set()
    for p in parts:
        for k, v in p.extra.items():
            if isinstance(v, list) and len(v) == len(p.options) and p.options and k != "shares_input_with":
                per_option_keys.add(k)
    for p in parts:
        for j, o in enumerate(p.options):
            by_desc[o.option.desc] = (o, {k: p.extra[k][j] for k in per_option_keys if k in p.extra})
    missing = [d for d in order if d not in by_desc]
    if missing:
        raise RuntimeError(f"{base.key}: options {missing} were measured on no rank")
    base.options = [by_desc[d][0] for d in order]
    for k in per_option_keys:
        base.extra[k] = [by_desc[d][1][k] for d in order]
    for p in parts[1:]:
        for k, v in p.extra.items():
            if k not in base.extra:
                base.extra[k] = v
    return base


def gather_layer(records: list, imp: dict, refs: dict, owner: dict[tuple[str, str], int],
                 order: Sequence[str]) -> tuple[list, dict, dict]:
    """Every rank's partial records, importances and reference weights of one layer, merged on every rank.

    ``owner`` maps (tensor, option) to its rank in measuring order; ``order``
    lists the tensors in the order one process would hold them.
    """
    every = gather_objects((records, imp, refs))
    descs: dict[str, list[str]] = {}
    for p, d in owner:
        descs.setdefault(p, []).append(d)
    merged = [merge_records([e[0][j] for e in every], descs[rec.key]) for j, rec in enumerate(records)]
    all_imp = {k: v for e in every for k, v in e[1].items()}
    all_refs = {k: v for e in every for k, v in e[2].items()}
    return (merged, {k: all_imp[k] for k in order if k in all_imp},
            {k: all_refs[k] for k in order if k in all_refs})
