"""The layer runner: one decoder layer of a model in memory at a time, run by mlx-lm's own code.

Measuring and quantizing both stream a model this way: build the model's
skeleton (aligned to the checkpoint), load only the weights outside the decoder
layers, run the model up to its first layer once per calibration batch to get
the embedded rows and every layer's call arguments (masks, caches), then for
each layer load its weights, run it on the carried activations (a Gram
collector watching its linear layers) and free it. Peak memory is one layer
plus the calibration rows' hidden states, independent of depth.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlx_dq.errors import InputError
from mlx_dq.model.capture import GramCollector, quantizable_modules
from mlx_dq.model.cpu_forward import cpu_forward
from mlx_dq.model.sources import HALF_DTYPES
from mlx_dq.names import layer_index
from mlx_dq.runtime import distributed as dist
from mlx_dq.runtime.distributed import iter_batches

HEAD_CHUNK = 128  # positions per head call: logits are [chunk, vocab] float32, never [calibration tokens, vocab]


# --------------------------------------------------------------------------
# running parts of the model's own forward
# --------------------------------------------------------------------------
class _StopForward(Exception):
    """Raised by a patched layer to end a probing forward pass early."""


@contextmanager
def _patched_calls(modules: Sequence[nn.Module], make: Callable[[int, type], Callable]) -> Iterator[None]:
    """Temporarily give ``modules[j]`` the ``__call__`` returned by ``make(j, original_class)``."""
    saved = [m.__class__ for m in modules]
    try:
        for j, m in enumerate(modules):
            m.__class__ = type(saved[j].__name__, (saved[j],), {"__call__": make(j, saved[j])})
        yield
    finally:
        for m, cls in zip(modules, saved):
            m.__class__ = cls


_HALF: dict[type, type] = {}
HALF_BLOCK_BYTES = 64 << 20  # float32 bytes of a 16-bit weight's rows widened at once for a product
HALF_BLOCK_ALIGN = 64  # rows per block a multiple of this: BLAS kernels then sum each output as in the whole product
_LAZY = [0]  # > 0 inside lazy_products()


@contextmanager
def lazy_products() -> Iterator[None]:
    """Inside, modules of :func:`half_class` build their products without evaluating them: for a forward whose
    outputs are never read (recording a head's inputs costs no ``[positions x vocabulary]`` product)."""
    _LAZY[0] += 1
    try:
        yield
    finally:
        _LAZY[0] -= 1


def half_linear(mod: nn.Module, x: mx.array, eager: bool = True) -> mx.array | None:
    """``mod(x)`` for an ``nn.Linear`` whose weight is 16-bit and larger than :data:`HALF_BLOCK_BYTES` in float32,
    the product taken a block of output rows at a time, each evaluated into the output when ``eager``; None when
    ``mod`` is not such a layer.

    Why: MLX widens a 16-bit weight whole to meet a float32 input (0.94 GB for a Llama-3-70B MLP weight, 2.1 GB
    for Llama-3-8B's head), and in one lazy evaluation every block's widened copy is alive at once. Each output is
    the same dot product; with blocks of whole kernel tiles (:data:`HALF_BLOCK_ALIGN` rows, each block far above
    BLAS's small-matrix sizes) OpenBLAS gives the whole product's values bit for bit."""
    w = mod.get("weight") if isinstance(mod, nn.Linear) else None
    if w is None or w.ndim != 2 or w.dtype not in HALF_DTYPES or x.dtype != mx.float32 \
            or w.size * 4 <= HALF_BLOCK_BYTES:
        return None
    bias, rows = mod.get("bias"), int(w.shape[0])
    step = max(HALF_BLOCK_ALIGN, HALF_BLOCK_BYTES // (4 * int(w.shape[1])) // HALF_BLOCK_ALIGN * HALF_BLOCK_ALIGN)

    def block(s: int) -> mx.array:
        wb = w[s:s + step].astype(mx.float32).T
        return x @ wb if bias is None else mx.addmm(bias[s:s + step], x, wb)

    if not eager:
        return mx.concatenate([block(s) for s in range(0, rows, step)], axis=-1)
    out = mx.zeros(x.shape[:-1] + (rows,), dtype=mx.float32)
    for s in range(0, rows, step):
        out[..., s:s + step] = block(s)
        mx.eval(out)  # in place: the array's only reference
    return out


def half_class(cls: type) -> type:
    """A subclass of ``cls`` for modules holding a 16-bit weight: every call evaluates its output at once (outside
    :func:`lazy_products`), large linear products by :func:`half_linear`.

    Why: a 16-bit weight meets a float32 input through a float32 copy that MLX makes when it evaluates the
    product; in a lazy layer forward the copies of every weight would be alive at once, evaluated as they come only
    one is (docs/cost.md#figures-behind-the-code)."""
    if cls not in _HALF:
        linear = issubclass(cls, nn.Linear) and cls.__call__ is nn.Linear.__call__  # its call is the plain product

        def call(self, x, *args, **kwargs):
            eager = not _LAZY[0]
            y = half_linear(self, x, eager) if linear and not args and not kwargs else None
            y = cls.__call__(self, x, *args, **kwargs) if y is None else y
            if eager:
                mx.eval(y)
            return y

        _HALF[cls] = type(cls.__name__, (cls,), {"__call__": call, "_half_base": cls})
    return _HALF[cls]


def mark_half(modules: Iterable[nn.Module]) -> None:
    """Give each of ``modules`` whose weight is 16-bit the :func:`half_class` of its class (once)."""
    for m in modules:
        if m.weight.dtype in HALF_DTYPES and "_half_base" not in type(m).__dict__:
            m.__class__ = half_class(type(m))


def plain_class(module: nn.Module) -> None:
    """Undo :func:`half_class` on ``module``."""
    while "_half_base" in type(module).__dict__:
        module.__class__ = type(module).__dict__["_half_base"]


def layer_prefix(model: nn.Module, layers: Sequence[nn.Module]) -> str:
    """Dotted prefix of the decoder layers in ``model`` (e.g. ``"model.layers."``)."""
    for path, mod in model.named_modules():
        if mod is layers[0]:
            return path[: -len("0")]
    raise ValueError("the model's decoder layers are not among its modules")


def load_into(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Load ``weights`` (full parameter paths) into ``model`` in their dtypes, sanitizing raw names when needed.

    The dtypes are :meth:`~mlx_dq.model.sources.ModelSource.load_weights`' own: float32, or a 16-bit source dtype where
    it was asked to keep one (float32 holds its values exactly, so a float32 input still gets float32 products)."""
    params = dict(tree_flatten(model.parameters()))
    if any(k not in params for k in weights) and hasattr(model, "sanitize"):
        weights = model.sanitize(dict(weights))
    unknown = sorted(k for k in weights if k not in params)
    if unknown:
        raise InputError(f"weights not in the model: {unknown[:5]}")
    for k, v in weights.items():  # a freed parameter (empty) was checked when first loaded
        if params[k].size and tuple(v.shape) != tuple(params[k].shape):
            raise InputError(f"{k}: weight shape {tuple(v.shape)} does not match the model's {tuple(params[k].shape)}")
    model.load_weights(list(weights.items()), strict=False)


def align_to_source(model: nn.Module, names: Sequence[str]) -> None:
    """Let the model's own ``sanitize`` adapt the skeleton to the checkpoint (e.g. drop an absent, tied head)."""
    params = dict(tree_flatten(model.parameters()))
    known = set(names)
    if hasattr(model, "sanitize") and any(k not in known for k in params):
        model.sanitize({k: v for k, v in params.items() if k in known})


def free_module(module: nn.Module) -> None:
    """Drop a module's loaded parameters (replaced by empty arrays) so their memory is released."""
    module.update(tree_map(lambda _: mx.zeros((0,), dtype=mx.float32), module.parameters()))


def free_table(module: nn.Module) -> None:
    """Replace an embedding's table by a zero view of its shape (no memory): calls still embed tokens (as zeros)."""
    module.weight = mx.broadcast_to(mx.zeros((1, module.weight.shape[-1]), mx.float32), module.weight.shape)


def lookup_tables(outside: dict[str, nn.Module]) -> list[str]:
    """Paths of the embeddings among ``outside`` (the modules outside the decoder layers) used only as lookup tables
    (an untied model's, beside its own head): they are measured and quantized with nothing else outside loaded."""
    return [p for p, m in outside.items() if isinstance(m, nn.Embedding)] if len(outside) > 1 else []


def probe_layers(model: nn.Module, tokens: mx.array) -> tuple[mx.array, list[tuple[tuple, dict]]]:
    """Run ``model`` on ``tokens`` up to its first decoder layer and record every layer's call.

    Returns the first layer's input (the embedded rows, scaled as the model
    scales them) and, per layer, the other arguments it is called with (masks,
    caches), so each layer can later be run alone exactly as the model runs it.
    Only the embedding's weights are needed.
    """
    layers = model.layers
    calls: list[tuple[tuple, dict] | None] = [None] * len(layers)
    first: list[mx.array] = []

    def make(j: int, cls: type) -> Callable:
        def call(self, h, *args, **kwargs):
            if j == 0:
                first.append(h)
            calls[j] = (args, kwargs)
            if j == len(layers) - 1:
                raise _StopForward
            return h

        return call

    with _patched_calls(layers, make):
        try:
            model(tokens)
        except _StopForward:
            pass
    if not first or any(c is None for c in calls):
        raise ValueError("the model's forward did not call every decoder layer once")
    return first[0].astype(mx.float32), calls  # type: ignore[return-value]


def head_logits(model: nn.Module, tokens: mx.array, hidden: mx.array) -> mx.array:
    """Logits the model produces when its last decoder layer outputs ``hidden``.

    Runs the model's own forward with the decoder layers replaced by a
    pass-through that injects ``hidden``, so the final norm, head (tied or not)
    and any logit scaling are mlx-lm's.
    """

    def make(j: int, cls: type) -> Callable:
        def call(self, h, *args, **kwargs):
            return hidden if j == 0 else h

        return call

    with _patched_calls(model.layers, make):
        return model(tokens).astype(mx.float32)


def position_chunks(seq_len: int, chunk: int = HEAD_CHUNK) -> list[slice]:
    """Consecutive position slices of at most ``chunk`` positions (the head runs on one at a time)."""
    if chunk < 1:
        raise ValueError(f"head chunk must be >= 1, got {chunk}")
    return list(iter_batches(seq_len, chunk))


def record_head_inputs(model: nn.Module, tokens: mx.array, hidden: mx.array, flush: Callable[[], None],
                       chunk: int = HEAD_CHUNK) -> None:
    """Let a Gram collector watching the head record its inputs for ``hidden``, ``chunk`` positions at a time
    (``flush`` after each), without evaluating any logits: the head's Gram costs no ``[positions x vocabulary]``
    matmul."""
    for psl in position_chunks(int(tokens.shape[1]), chunk):
        with lazy_products():
            head_logits(model, tokens[:, psl], hidden[:, psl])  # lazy: only the recorded input is ever evaluated
        flush()


# --------------------------------------------------------------------------
# streaming a model layer by layer
# --------------------------------------------------------------------------
class LayerRunner:
    """Streams ``source`` one decoder layer at a time over calibration ``tokens``, in batches of ``batch_size`` rows.

    ``share`` says which batches this rank runs (every batch with one process);
    ``expert_mode`` how expert banks' inputs are collected (see :class:`~mlx_dq.model.capture.GramCollector`).
    """

    def __init__(self, source: Any, tokens: mx.array, batch_size: int, share: dist.RowShare | None = None,
                 expert_mode: str = "per_expert"):
        from mlx_dq.model.sources import build_model

        self.source, self.tokens, self.expert_mode = source, tokens, expert_mode
        self.net = build_model(source.config)
        align_to_source(self.net, source.weight_names())
        self.layers = self.net.layers
        self.prefix = layer_prefix(self.net, self.layers)
        self.batches = list(iter_batches(int(tokens.shape[0]), batch_size))
        self.share = share if share is not None else dist.RowShare(int(tokens.shape[0]), batch_size)
        self.calls: list[list[tuple[tuple, dict]]] = []

    def collector(self, mods: dict[str, nn.Module], output_energy: bool = False) -> GramCollector:
        """A Gram collector over ``mods`` with this runner's expert mode; ``output_energy``: also each linear
        layer's output energy per channel."""
        return GramCollector(mods, self.expert_mode, output_energy=output_energy)

    def load_outside(self, only: Sequence[str] | None = None, skip: Sequence[str] = (), half: bool = True) -> None:
        """Load the weights outside the decoder layers (embedding, final norm, head); ``only`` / ``skip``: just the
        modules at these paths, or all but them (so a large table can be measured while the head is not held).

        With ``half``, an untied head and a table used only for lookups keep a 16-bit source dtype: the head's
        products widen a block of its rows at a time (:func:`half_linear`) and the quantizers read rows in float32.
        Why: in float32 the 128,256 x 4,096 head of Llama-3-8B alone is 2.1 GB, most of the bound on one layer."""
        def wanted(name: str) -> bool:
            if any(name.startswith(p + ".") for p in skip):
                return False
            return only is None or any(name.startswith(p + ".") for p in only)

        outside = self.outside_modules()
        tables = lookup_tables(outside)
        halves = [p for p, m in outside.items() if p in tables or isinstance(m, nn.Linear)] if half else []
        load_into(self.net, self.source.load_weights(
            (n for n in self.source.weight_names() if layer_index(n) is None and wanted(n)),
            as_stored={f"{p}.weight" for p in halves}))
        mark_half(outside[p] for p in halves)

    def load_for_probe(self) -> None:
        """Load what embedding the rows needs: the weights outside the decoder layers but an untied head.

        Why: :meth:`probe` stops at the decoder layers, so a head beside its own embedding is never used
        there; at Llama-3-8B's 128,256 x 4,096 it is 2.1 GB in float32 (and its 16-bit copy while loading). The
        table is float32 there: the rows it embeds are the layers' float32 inputs."""
        tables = self.lookup_tables()
        self.load_outside(skip=[p for p in self.outside_modules() if p not in tables] if tables else (), half=False)

    def free_outside(self) -> None:
        """Release the embedding and head (``load_outside`` brings them back): the decoder layers never use them.

        Why: in float32 they are most of a large-vocabulary model's memory outside one layer (4.2 GB at
        Llama-3-8B's 128,256 x 4,096), held through every layer for nothing."""
        for mod in self.outside_modules().values():
            plain_class(mod)
            free_module(mod)

    def probe(self, flush: Callable[[], None] | None = None) -> list[mx.array]:
        """Embed every batch (after :meth:`load_outside`) and record each decoder layer's call arguments.

        Returns the first layer's input per batch (every batch, run by any rank);
        ``flush`` is called after each batch (an embedding collector).
        """
        firsts = []
        for sl in self.batches:
            h0, call = probe_layers(self.net, self.tokens[sl])
            mx.eval(h0)
            if flush is not None:
                flush()
            self.calls.append(call)
            firsts.append(h0)
        return firsts

    def join(self, firsts: list[mx.array]) -> Any:
        """The hidden states this rank carries, from per-batch arrays of every batch."""
        return self.share.join([f for b, f in enumerate(firsts) if self.share.runs(b)])

    def load(self, i: int) -> dict[str, nn.Module]:
        """Load decoder layer ``i``'s weights; return its quantizable modules by full path.

        The weights of its linear layers and expert banks stay in their 16-bit source dtype (the rest in float32);
        the quantizers read them a block of rows at a time in float32. Why: half the layer's memory between uses
        (0.44 GB at Llama-3-8B, 1.7 GB at Llama-3-70B)."""
        mods = quantizable_modules(self.layers[i], prefix=f"{self.prefix}{i}.")
        stored = {f"{p}.weight" for p, m in mods.items() if not isinstance(m, nn.Embedding)}
        load_into(self.net, dict(self.source.layer_weights(i, stored)))
        mark_half(mods.values())
        return mods

    def forward(self, i: int, hidden: Any, col: GramCollector | None = None) -> Any:
        """Layer ``i``'s float32 output on ``hidden`` (this rank's batches); ``col`` collects its inputs (all ranks' sums)."""
        layer = self.layers[i]
        ys = {}
        with cpu_forward():  # swapped in once for the batches, not once a batch
            for b, sl in enumerate(self.batches):
                if not self.share.owns(b):  # another rank's batch (its importance rows arrive from it below)
                    continue
                args, kwargs = self.calls[b][i]
                y = layer(hidden[sl], *args, **kwargs).astype(mx.float32)
                mx.eval(y)
                if col is not None:
                    self.share.flush(col, b)
                ys[b] = y
        if col is not None:
            dist.reduce_stats(col)
        return self.share.join_owned(ys)

    def free(self, i: int) -> None:
        """Release layer ``i``'s weights."""
        for _, m in self.layers[i].named_modules():
            plain_class(m)
        free_module(self.layers[i])

    def lookup_tables(self) -> list[str]:
        """:func:`lookup_tables` of this model's modules outside the decoder layers."""
        return lookup_tables(self.outside_modules())

    def outside_modules(self) -> dict[str, nn.Module]:
        """The quantizable modules outside the decoder layers (embedding, head), by full path."""
        return {p: m for p, m in quantizable_modules(self.net).items() if not p.startswith(self.prefix)}
