"""The blocked head KL: KL(fp || quantized) of the next-token distribution with memory bounded for any vocabulary.

The head runs a chunk of positions or a block of vocabulary rows at a time (an online log-sum-exp), so the logits
never exceed ``[chunk, vocab]`` floats: for carried perturbations (sampled layers, lookup tables) and head options.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dq.measure.meter import ErrorMeter
from mlx_dq.measure.swap import weight_as
from mlx_dq.model.capture import InputStats
from mlx_dq.model.runner import HEAD_CHUNK, head_logits, position_chunks
from mlx_dq.model.sources import HALF_DTYPES
from mlx_dq.quant.dispatch import row_blocks
from mlx_dq.runtime.distributed import iter_batches

REF_CACHE_BYTES = 128 * 2**20  # reference log-probabilities kept for the head's KL (carried perturbations and
# one-block heads; a larger head's options go block by block); the rest are recomputed


def chunked_nll_sum(model: nn.Module, tokens: mx.array, hidden: mx.array, chunk: int = HEAD_CHUNK,
                    flush: Callable[[], None] | None = None) -> float:
    """Summed next-token NLL of ``tokens`` from final hidden states, the head run ``chunk`` positions at a time.

    Equals the summed cross-entropy of ``head_logits(model, tokens, hidden)`` (norm and head act per
    position) without materialising more than ``[rows, chunk, vocab]`` logits.
    ``flush`` is called after each chunk (a Gram collector watching the head).
    """
    seq = int(tokens.shape[1])
    total = 0.0
    for sl in position_chunks(seq, chunk):
        n_t = min(sl.stop, seq - 1) - sl.start  # positions of this chunk that have a next token
        logits = head_logits(model, tokens[:, sl], hidden[:, sl])
        if n_t > 0:
            loss = nn.losses.cross_entropy(logits[:, :n_t], tokens[:, sl.start + 1:sl.start + 1 + n_t],
                                           reduction="sum")
            total += float(loss.item())
        if flush is not None:
            flush()
        del logits
    return total


@mx.compile
def _kl_rows(ref_logp: mx.array, logits: mx.array) -> mx.array:
    """Summed KL(ref || q) over the positions of one row (nats).

    Compiled: the elementwise steps fuse, so fewer ``[positions, vocab]`` float32
    temporaries are live (the same values as the uncompiled expression).
    """
    logp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
    return (mx.exp(ref_logp) * (ref_logp - logp)).sum()


def _swap_dtype(w: mx.array) -> mx.Dtype:
    """The dtype a quantized stand-in for ``w`` takes in the head: a 16-bit head's is float32 (its values are not
    16-bit numbers), the product being float32 anyway."""
    return mx.float32 if w.dtype in HALF_DTYPES else w.dtype


class HeadKL:
    """End-to-end KL from the final hidden states of the importance rows: for carried perturbations and head options.

    Two ways through the head. :meth:`kl_many` (carried copies) and :class:`HeadBlockKL` (head options) go a block
    of vocabulary rows at a time, every position of the block before the next: each block of a 16-bit head is
    widened once per pass, the products have all the positions the logit budget allows, and the reference
    log-normaliser comes from the same pass (online, as in a blocked softmax). :meth:`kl` runs the whole head
    ``chunk`` positions at a time with the reference log-probabilities of the first chunks cached up to
    ``cache_bytes`` (built on first use; the others recomputed). Either way memory stays bounded for any
    vocabulary and number of rows: logits never exceed ``[chunk, vocab]`` floats.
    """

    def __init__(self, model: nn.Module, tokens: mx.array, hidden: mx.array, chunk: int = HEAD_CHUNK,
                 cache_bytes: int = REF_CACHE_BYTES):
        self.model, self.tokens, self.hidden = model, tokens, hidden
        self.chunk, self.cache_bytes = chunk, cache_bytes
        self.chunks = [(r, sl) for r in range(int(tokens.shape[0])) for sl in position_chunks(int(tokens.shape[1]),
                                                                                              chunk)]
        self.ref: list[mx.array | None] | None = None  # the cached reference log-probabilities (kl), when built
        self.cached_bytes = self.recomputed = 0
        self.positions = int(tokens.shape[0]) * int(tokens.shape[1])
        self._norm: tuple[mx.array, mx.array] | None = None  # the reference's maximum and sum per position, flat

    def _ref_cache(self) -> list[mx.array | None]:
        """The reference log-probabilities of the first chunks, up to ``cache_bytes`` (built once)."""
        if self.ref is not None:
            return self.ref
        self.ref, used, per_pos = [], 0, None
        for r, sl in self.chunks:
            lp = None
            if per_pos is None or used + per_pos * (sl.stop - sl.start) <= self.cache_bytes:
                lp = self._ref_logp(r, sl)
                mx.eval(lp)
                per_pos = lp.nbytes // (sl.stop - sl.start)
                if used + lp.nbytes > self.cache_bytes:
                    lp = None
                else:
                    used += lp.nbytes
            self.ref.append(lp)
        self.cached_bytes = used
        self.recomputed = sum(lp is None for lp in self.ref)
        return self.ref

    def _ref_logp(self, r: int, sl: slice) -> mx.array:
        logits = head_logits(self.model, self.tokens[r:r + 1, sl], self.hidden[r:r + 1, sl])
        return nn.log_softmax(logits.astype(mx.float32), axis=-1)

    def kl(self, hidden: mx.array, swap: tuple[nn.Module, mx.array] | None = None) -> float:
        """Mean KL per position when the final hidden states are ``hidden`` (and ``swap=(mod, wq)`` sets a weight)."""
        total = 0.0
        for (r, sl), lp in zip(self.chunks, self._ref_cache()):
            if lp is None:
                lp = self._ref_logp(r, sl)  # with the original weights
            if swap is not None:
                with weight_as(*swap):
                    logits = head_logits(self.model, self.tokens[r:r + 1, sl], hidden[r:r + 1, sl])
                    total += _kl_rows(lp, logits).item()
            else:
                total += _kl_rows(lp, head_logits(self.model, self.tokens[r:r + 1, sl], hidden[r:r + 1, sl])).item()
        return total / self.positions

    def flat(self, hidden: mx.array) -> mx.array:
        """``hidden`` ``[rows, positions, channels]`` as one row: the norm and head act per position."""
        return hidden.reshape(1, self.positions, int(hidden.shape[-1]))

    def spans(self, block_rows: int, vocab: int, positions: slice | None = None) -> list[slice]:
        """Slices of the flat rows' ``positions`` (default: all) for products with ``block_rows`` vocabulary rows:
        at most ``chunk x vocab`` logits each, the bound of a :meth:`kl` call over the whole head."""
        lo, hi = (0, self.positions) if positions is None else (positions.start, positions.stop)
        return [slice(lo + c.start, lo + c.stop)
                for c in iter_batches(hi - lo, max(1, self.chunk * vocab // max(1, block_rows)))]

    def blocks(self, mod: nn.Module) -> list[slice]:
        """Blocks of the head's vocabulary rows for :meth:`kl_many` (:func:`row_blocks`' blocks, or one)."""
        w = mod.weight
        return row_blocks(tuple(w.shape)) or [slice(0, int(w.shape[0]))]

    def kl_many(self, mod: nn.Module, hiddens: Sequence[mx.array]) -> list[float]:
        """Mean KL per position for each of ``hiddens`` (final hidden states), in one pass over the head ``mod``'s
        vocabulary blocks; the reference logits' running maximum and sum are kept for :meth:`ref_norm`.

        Per position, with ``r`` the reference logits, ``q`` another's, ``M`` and ``M'`` their running maxima:
        ``S = sum exp(r - M)``, ``D = sum exp(r - M) (r - q)`` and ``S' = sum exp(q - M')`` add up over blocks
        (rescaled when a maximum grows); then ``KL = D / S + (M' - M) + log(S' / S)``. Taking the log of the ratio
        keeps float32's error at the KL's scale, not at ``log(vocabulary)``'s."""
        return self.kls_from_sums(self.position_sums(mod, hiddens, slice(0, self.positions)))

    def position_sums(self, mod: nn.Module, hiddens: Sequence[mx.array], positions: slice) -> dict[str, mx.array]:
        """:meth:`kl_many`'s per-position ``M``, ``S`` and, per hidden, ``M'``, ``S'``, ``D`` (``[hiddens,
        n]``) for the flat ``positions`` only: each position's values do not depend on the others, so ranks can
        take a share of the positions each and concatenate (:meth:`kls_from_sums`: the same as one process)."""
        w = mod.weight
        blocks = self.blocks(mod)
        n = positions.stop - positions.start
        spans = self.spans(max(b.stop - b.start for b in blocks), int(w.shape[0]), positions)
        hs = [self.flat(self.hidden)] + [self.flat(h) for h in hiddens]
        zeros = mx.zeros((1, self.positions), dtype=self.tokens.dtype)  # the lookup's output is replaced
        new = lambda: [mx.full((c.stop - c.start,), -mx.inf, dtype=mx.float32) for c in spans]  # noqa: E731
        m, s = new(), [mx.zeros((c.stop - c.start,), dtype=mx.float32) for c in spans]
        acc = [(new(), [mx.zeros_like(x) for x in s], [mx.zeros_like(x) for x in s]) for _ in hiddens]  # M', S', D
        for sl in blocks:
            with weight_as(mod, w[sl].astype(_swap_dtype(w))):
                mx.eval(mod.weight)  # widened once for every position
                for c, ps in enumerate(spans):
                    r = head_logits(self.model, zeros[:, ps], hs[0][:, ps])[0]
                    m_new, scale, e, s[c] = _online_ref(m[c], s[c], r)
                    for j, (mq, sq, dot) in enumerate(acc):
                        q = head_logits(self.model, zeros[:, ps], hs[j + 1][:, ps])[0]
                        mq[c], sq[c], dot[c] = _online_other(mq[c], sq[c], dot[c], scale, e, r, q)
                    m[c] = m_new
                    mx.eval(m[c], s[c], *[x[c] for a in acc for x in a])
        cat = lambda xs: mx.concatenate(xs) if xs else mx.zeros((0,), dtype=mx.float32)  # noqa: E731
        stack = lambda i: mx.stack([cat(a[i]) for a in acc]) if acc else mx.zeros((0, n), dtype=mx.float32)  # noqa: E731
        return {"m": cat(m), "s": cat(s), "mq": stack(0), "sq": stack(1), "d": stack(2)}

    def kls_from_sums(self, sums: dict[str, mx.array]) -> list[float]:
        """Mean KL per position of each hidden from :meth:`position_sums` over every position (keeps ``M``, ``S``
        for :meth:`ref_norm`)."""
        self._norm = m_all, s_all = sums["m"], sums["s"]
        return [((d / s_all + (mq - m_all) + mx.log(sq / s_all)).sum().item()) / self.positions
                for mq, sq, d in zip(sums["mq"], sums["sq"], sums["d"])]

    @staticmethod
    def join_sums(parts: Sequence[dict[str, mx.array]]) -> dict[str, mx.array]:
        """Ranks' :meth:`position_sums` of consecutive position shares, in order, as one process's."""
        return {"m": mx.concatenate([p["m"] for p in parts]), "s": mx.concatenate([p["s"] for p in parts]),
                **{k: mx.concatenate([p[k] for p in parts], axis=1) for k in ("mq", "sq", "d")}}

    def ref_norm(self, mod: nn.Module) -> tuple[mx.array, mx.array]:
        """The reference logits' maximum ``M`` and ``sum exp(r - M)`` per position, flat (one :meth:`kl_many` pass,
        once): ``LSE(r) = M + log S``."""
        if self._norm is None:
            self.kl_many(mod, [])
        return self._norm

    def damage_fn(self, mod: nn.Module) -> Callable[[mx.array], float]:
        """``wq -> KL`` with the head (or tied embedding) weight of ``mod`` replaced by ``wq``.

        Its ``blocks()`` gives the same KL fed one block of vocabulary rows at a
        time (:class:`HeadBlockKL`), so no dequantized copy of a large head is built.
        """

        def fn(wq: mx.array) -> float:
            return self.kl(self.hidden, swap=(mod, wq.astype(_swap_dtype(mod.weight))))

        fn.blocks = lambda: HeadBlockKL(self, mod)  # type: ignore[attr-defined]
        return fn


@mx.compile
def _online_ref(m: mx.array, s: mx.array, r: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One block of reference logits ``r`` ``[positions, rows]`` into the running maximum ``m`` and sum ``s``:
    the new maximum, the rescale factor of the old sums, ``exp(r - max)`` and the new sum."""
    m_new = mx.maximum(m, r.max(-1))
    scale = mx.exp(m - m_new)
    e = mx.exp(r - m_new[:, None])
    return m_new, scale, e, s * scale + e.sum(-1)


def _running_sum_exp(mq: mx.array, sq: mx.array, q: mx.array) -> tuple[mx.array, mx.array]:
    """One block of logits ``q`` ``[positions, rows]`` into a running maximum ``mq`` and ``sum exp(q - max)``."""
    mq_new = mx.maximum(mq, q.max(-1))
    return mq_new, sq * mx.exp(mq - mq_new) + mx.exp(q - mq_new[:, None]).sum(-1)


@mx.compile
def _online_other(mq: mx.array, sq: mx.array, dot: mx.array, scale: mx.array, e: mx.array, r: mx.array,
                  q: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """One block of another's logits ``q`` into its running maximum and ``sum exp(q - max)`` and the running
    ``sum exp(r - M) (r - q)`` (``scale``, ``e``: from :func:`_online_ref`)."""
    return *_running_sum_exp(mq, sq, q), dot * scale + (e * (r - q)).sum(-1)


class HeadBlockKL:
    """One head option's KL accumulated over blocks of vocabulary rows: memory bounded by the block, not the vocabulary.

    Per position, ``KL(ref || q) = sum_v p_v (r_v - q_v) + LSE(q) - LSE(r)`` with
    ``r``, ``q`` the reference and quantized logits and ``p = softmax(r)``. The
    sum and ``LSE(q)`` (by ``logaddexp``) add up over blocks, so each block's
    original and quantized rows go through the model's own head in one call (the
    two stacked as one weight), for as many positions as the logit budget allows
    (:meth:`HeadKL.spans`), and its logits are dropped. Why: the whole
    dequantized head was one more float32 copy of the vocabulary x hidden matrix
    (519 MiB at 151,936 x 896), the largest item of the head stage's peak.
    Logit transforms must act per logit (scaling, soft-capping), as in mlx-lm's models.
    """

    def __init__(self, head: HeadKL, mod: nn.Module):
        self.head, self.mod = head, mod
        self.m_ref, self.s_ref = head.ref_norm(mod)
        self.lse_ref = self.m_ref + mx.log(self.s_ref)
        self.vocab = int(mod.weight.shape[0])
        self.hidden = head.flat(head.hidden)
        self.dot = mx.zeros_like(self.lse_ref)
        self.m_q = mx.full(self.lse_ref.shape, -mx.inf, dtype=mx.float32)
        self.s_q = mx.zeros_like(self.lse_ref)
        self.zeros = mx.zeros((1, head.positions), dtype=head.tokens.dtype)  # ids must fit the stacked rows

    def add(self, i: int, sl: slice, wq: mx.array) -> None:
        """Account for vocabulary rows ``sl`` (row block ``i``) quantized to ``wq``."""
        w, h = self.mod.weight, self.head
        n, dt = int(wq.shape[0]), _swap_dtype(w)
        with weight_as(self.mod, mx.concatenate([w[sl].astype(dt), wq.astype(dt)])):
            for ps in h.spans(2 * n, self.vocab):
                logits = head_logits(h.model, self.zeros[:, ps], self.hidden[:, ps])[0]
                self.m_q[ps], self.s_q[ps], self.dot[ps] = _block_other(
                    self.m_q[ps], self.s_q[ps], self.dot[ps], self.lse_ref[ps], logits[..., :n], logits[..., n:])
                mx.eval(self.dot, self.m_q, self.s_q)

    def value(self) -> float:
        """Mean KL per position over every block added (all the vocabulary rows)."""
        kl = self.dot + (self.m_q - self.m_ref) + mx.log(self.s_q / self.s_ref)
        return kl.sum().item() / self.head.positions


@mx.compile
def _block_other(mq: mx.array, sq: mx.array, dot: mx.array, lse_ref: mx.array, r: mx.array,
                 q: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """A block of quantized logits ``q`` (reference ``r``) into the running maximum and ``sum exp(q - max)`` of
    ``q`` and the running ``sum p (r - q)``, ``p = exp(r - LSE(r))``."""
    return *_running_sum_exp(mq, sq, q), dot + (mx.exp(r - lse_ref[:, None]) * (r - q)).sum(-1)


def add_lookup_damage(head_fn: Callable[[mx.array], float], w: mx.array, lookup: InputStats,
                      importance: float) -> Callable[[mx.array], float]:
    """A tied head's damage: its measured KL plus ``importance * err**2`` of the lookup (token-count weighted).

    The lookup side cannot be measured end to end in the same pass (its effect runs through every layer),
    and it is not small (see docs/pipeline.md).
    """
    meter = ErrorMeter(w, None, lookup.token_counts)
    parts: list[float] = []

    def fn(wq: mx.array) -> float:
        parts.append(importance * meter(wq)[0] ** 2)
        return head_fn(wq) + parts[-1]

    fn.lookup_damage = parts  # type: ignore[attr-defined]
    if hasattr(head_fn, "blocks"):
        fn.blocks = lambda: _LookupBlocks(head_fn.blocks(), meter, importance, parts)  # type: ignore[attr-defined]
    return fn


class _LookupBlocks:
    """:func:`add_lookup_damage`'s sum fed block by block: the head's block KL plus the lookup meter's block sums."""

    def __init__(self, head: "HeadBlockKL", meter: ErrorMeter, importance: float, parts: list[float]):
        self.head, self.meter, self.importance, self.parts = head, meter, importance, parts
        self.sums = [0.0, 0.0]

    def add(self, i: int, sl: slice, wq: mx.array) -> None:
        """Row block ``i`` (rows ``sl``; the measurer's row blocks are the meter's) quantized to ``wq``."""
        self.head.add(i, sl, wq)
        o, w_ = self.meter.partial(i, wq)
        self.sums = [self.sums[0] + o, self.sums[1] + w_]

    def value(self) -> float:
        self.parts.append(self.importance * self.meter.result(*self.sums)[0] ** 2)
        return self.head.value() + self.parts[-1]
