"""Input capture: accumulate Gram matrices X^T X of the inputs of linear layers.

Works on any ``mlx.nn.Module``: while a :class:`GramCollector` is active, every
watched ``nn.Linear``, expert bank (mlx-lm ``SwitchLinear``) and ``nn.Embedding``
(lookups and ``as_linear`` for tied heads) records what it receives; ``flush()``
folds the recorded inputs into float32 Gram matrices. Modules fed the very same
input array in one forward (q/k/v, gate/up) share one Gram matrix. Expert banks
get one Gram matrix per expert, built from the tokens routed to that expert only.

The capture swaps each watched instance's class for a subclass with a recording
``__call__`` (Python looks ``__call__`` up on the type) and restores it on exit,
so the model's own forward code runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

try:  # mlx-lm's expert bank; optional so the generic path needs only mlx
    from mlx_lm.models.switch_layers import SwitchLinear
except ImportError:  # pragma: no cover - mlx-lm is a dependency
    SwitchLinear = None  # type: ignore[assignment,misc]


GRAM_CHUNK_BYTES = 64 * 2**20  # float32 bytes of the piece of X^T X made at a time when added to a large Gram


def add_gram(gram: mx.array | None, x: mx.array) -> mx.array:
    """``gram + x^T x`` (``x^T x`` when ``gram`` is None) for float32 rows ``x`` ``[n, k]``.

    A Gram of more than :data:`GRAM_CHUNK_BYTES` is added to in its own buffer, ``x^T x`` made a block of
    columns at a time. Why: the whole product beside the running sum is a second ``k x k`` array (822 MB at
    Llama-3-8B's 14,336-channel ``down_proj`` input, 3.3 GB at Llama-3-70B's 28,672). Every entry gets the
    same additions either way (the running sum plus its product entry), so the order of the sums over batches
    (and over ranks, :func:`mlx_dq.runtime.distributed.reduce_stats`) is unchanged. ``gram`` must be this caller's alone.
    """
    k = int(x.shape[-1])
    step = max(1, GRAM_CHUNK_BYTES // (4 * k))
    if step >= k:
        return x.T @ x if gram is None else gram + x.T @ x
    if gram is None:
        gram = mx.zeros((k, k), dtype=mx.float32)
    mx.eval(gram, x)
    a = np.asarray(gram)  # a writable view of the Gram's buffer
    for c0 in range(0, k, step):
        part = x.T @ x[:, c0 : c0 + step]
        mx.eval(part)
        a[:, c0 : c0 + step] += np.asarray(part)
    return gram


def is_expert_bank(module: nn.Module) -> bool:
    """True for an mlx-lm ``SwitchLinear`` (weight ``[experts, out, in]``)."""
    return SwitchLinear is not None and isinstance(module, SwitchLinear)


def quantizable_modules(module: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """Linear layers, expert banks and embeddings of ``module``, keyed by dotted path.

    ``prefix`` is prepended to every path (e.g. ``"model.layers.3."``).
    """
    found = {}
    for path, mod in module.named_modules():
        if path and (isinstance(mod, (nn.Linear, nn.Embedding)) or is_expert_bank(mod)):
            found[prefix + path] = mod
    return found


@dataclass
class InputStats:
    """What one watched module saw: its (possibly shared) Gram matrix and row count.

    ``gram`` is ``[in, in]`` for a linear layer or tied head, ``[experts, in, in]``
    for an expert bank; ``token_counts`` (``[vocab]``) is set for embedding lookups.
    ``group`` names every module that shares the same input.
    """

    gram: mx.array | None = None
    rows: int = 0
    expert_rows: np.ndarray | None = None
    token_counts: np.ndarray | None = None
    group: tuple[str, ...] = ()


@dataclass
class _Pending:
    path: str
    kind: str  # "linear", "bank", "lookup"
    x: mx.array
    indices: mx.array | None = None


@dataclass
class GramCollector:
    """Context manager that records the inputs of ``modules`` and accumulates Grams.

    ``expert_mode`` is ``"per_expert"`` (one Gram per expert from its routed
    tokens: exact) or ``"shared"`` (one Gram over every routed token of the bank).
    """

    modules: dict[str, nn.Module]
    expert_mode: str = "per_expert"
    output_energy: bool = False
    stats: dict[str, InputStats] = field(default_factory=dict)
    lookups: dict[str, InputStats] = field(default_factory=dict)
    energies: dict[str, mx.array] = field(default_factory=dict)
    _pending: list[_Pending] = field(default_factory=list)
    _pending_out: list[tuple[str, mx.array]] = field(default_factory=list)
    _saved: dict[str, type] = field(default_factory=dict)
    _groups: dict[tuple[str, ...], InputStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.expert_mode not in ("per_expert", "shared"):
            raise ValueError(f"expert_mode must be 'per_expert' or 'shared', got {self.expert_mode!r}")

    # ------------------------------------------------------------ patching
    def __enter__(self) -> "GramCollector":
        for path, mod in self.modules.items():
            self._saved[path] = mod.__class__
            mod.__class__ = _recording_class(mod.__class__, self, path)
        return self

    def __exit__(self, *exc) -> None:
        for path, mod in self.modules.items():
            if path in self._saved:
                mod.__class__ = self._saved.pop(path)
        self._pending.clear()
        self._pending_out.clear()

    def take_inputs(self) -> dict[str, mx.array]:
        """The inputs recorded since the last flush of plain linear layers, by path, as ``[rows, in]`` float32;
        they are then not folded into Gram matrices (expert banks and lookups stay pending)."""
        out, keep = {}, []
        for p in self._pending:
            if p.kind == "linear" and p.path not in out:
                out[p.path] = p.x.reshape(-1, p.x.shape[-1]).astype(mx.float32)
            elif p.kind != "linear":
                keep.append(p)
        self._pending = keep
        return out

    def release(self) -> None:
        """Drop the accumulated Gram matrices (the other statistics stay), so their memory is freed."""
        for st in self.stats.values():
            st.gram = None

    def record(self, path: str, kind: str, x: mx.array, indices: mx.array | None = None) -> None:
        """Remember one input (called from the patched modules)."""
        self._pending.append(_Pending(path, kind, x, indices))

    def record_output(self, path: str, y: mx.array, bias: mx.array | None) -> None:
        """With ``output_energy``: remember a linear layer's output energy per output channel, ``sum_t (x_t w_i)^2``.

        Why: it equals ``w_i G w_i^T``, which a Gram would give at ``out x in^2`` multiply-adds per tensor
        (docs/cost.md#where-the-time-goes); from the output the forward made
        anyway it costs ``tokens x out`` additions. Evaluated at once, so the output is not held until the batch is
        flushed (0.7 GB of outputs in a Llama-3-70B layer's forward on 4 x 512 tokens)."""
        if self.output_energy:
            y = y.astype(mx.float32) if bias is None else y.astype(mx.float32) - bias.astype(mx.float32)
            e = mx.sum(mx.square(y.reshape(-1, y.shape[-1])), axis=0)
            mx.eval(e)
            self._pending_out.append((path, e))

    # ---------------------------------------------------------- accumulation
    def flush(self) -> None:
        """Fold every input recorded since the last flush into the Gram matrices."""
        by_input: dict[tuple, list[_Pending]] = {}
        for p in self._pending:
            key = (p.kind, id(p.x), id(p.indices) if p.indices is not None else 0)
            by_input.setdefault(key, []).append(p)
        self._pending.clear()
        touched = []
        for path, e in self._pending_out:
            self.energies[path] = e if path not in self.energies else self.energies[path] + e
            touched.append(self.energies[path])
        self._pending_out.clear()
        for entries in by_input.values():
            paths = tuple(sorted({e.path for e in entries}))
            first = entries[0]
            if first.kind == "lookup":
                st = self.lookups.setdefault(first.path, InputStats(group=(first.path,)))
                ids = np.asarray(first.x).reshape(-1).astype(np.int64)
                vocab = int(self.modules[first.path].weight.shape[0])
                counts = np.bincount(ids, minlength=vocab).astype(np.float64)
                st.token_counts = counts if st.token_counts is None else st.token_counts + counts
                st.rows += ids.size
                continue
            st = self._group_stats(paths)
            if first.kind == "bank":
                gram, rows, per_expert = self._bank_gram(first)
                st.expert_rows = per_expert if st.expert_rows is None else st.expert_rows + per_expert
                st.gram = gram if st.gram is None else st.gram + gram
            else:
                xf = first.x.reshape(-1, first.x.shape[-1]).astype(mx.float32)
                st.gram, rows = add_gram(st.gram, xf), xf.shape[0]
            st.rows += rows
            touched.append(st.gram)
        if touched:
            mx.eval(touched)

    def _group_stats(self, paths: tuple[str, ...]) -> InputStats:
        st = self._groups.get(paths)
        if st is None:
            st = InputStats(group=paths)
            self._groups[paths] = st
            for p in paths:
                if p in self.stats and self.stats[p] is not st:
                    raise RuntimeError(f"{p} received inputs shared with different modules across batches")
                self.stats[p] = st
        return st

    def _bank_gram(self, p: _Pending) -> tuple[mx.array, int, np.ndarray]:
        x, idx = p.x, p.indices
        n_exp = int(self.modules[p.path].weight.shape[0])
        d = x.shape[-1]
        bshape = tuple(np.broadcast_shapes(tuple(x.shape[:-2]), tuple(idx.shape)))
        xf = mx.broadcast_to(x, bshape + tuple(x.shape[-2:])).reshape(-1, d).astype(mx.float32)
        reps = xf.shape[0] // int(np.prod(bshape))  # rows per routed token (1 in mlx-lm)
        flat_idx = np.repeat(np.asarray(mx.broadcast_to(idx, bshape)).reshape(-1), reps)
        counts = np.bincount(flat_idx, minlength=n_exp)
        if self.expert_mode == "shared":
            gram = (xf.T @ xf)[None]
            return gram, xf.shape[0], counts
        order = np.argsort(flat_idx, kind="stable")
        xs = xf[mx.array(order.astype(np.int32))]
        starts = np.concatenate([[0], np.cumsum(counts)])
        blocks = []
        for e in range(n_exp):
            if counts[e] == 0:
                blocks.append(mx.zeros((d, d), dtype=mx.float32))
            else:
                xe = xs[int(starts[e]) : int(starts[e + 1])]
                blocks.append(xe.T @ xe)
        return mx.stack(blocks), xf.shape[0], counts


def _recording_class(cls: type, collector: GramCollector, path: str) -> type:
    """A subclass of ``cls`` whose calls report their inputs to ``collector``."""

    if issubclass(cls, nn.Embedding):

        def call(self, x):
            collector.record(path, "lookup", x)
            return cls.__call__(self, x)

        def as_linear(self, x):
            collector.record(path, "linear", x)
            return cls.as_linear(self, x)

        return type(cls.__name__, (cls,), {"__call__": call, "as_linear": as_linear})

    if SwitchLinear is not None and issubclass(cls, SwitchLinear):

        def call(self, x, indices, *args, **kwargs):
            collector.record(path, "bank", x, indices)
            return cls.__call__(self, x, indices, *args, **kwargs)

        return type(cls.__name__, (cls,), {"__call__": call})

    def call(self, x, *args, **kwargs):
        collector.record(path, "linear", x)
        y = cls.__call__(self, x, *args, **kwargs)
        collector.record_output(path, y, self.get("bias") if isinstance(self, nn.Linear) else None)
        return y

    return type(cls.__name__, (cls,), {"__call__": call})
