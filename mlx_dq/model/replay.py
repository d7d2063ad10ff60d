"""Forward replay: rerun a module with one submodule changed, reusing the submodule calls it cannot affect.

A deterministic forward calls its submodules in the same order every time. When only submodule ``T`` changes
(its weight quantized), every submodule call that *ended* before ``T``'s first call began saw exactly the same
inputs as before, so its recorded output can stand in for running it again. :func:`record_calls` records one
forward's calls (which calls each made, the outputs of the calls some target may reuse); :func:`replay`
then makes each such call return its recorded output, on any ``nn.Module``.

Why: the residual importance reruns a decoder layer once per tensor; for a Llama MLP's ``down_proj`` the
attention block and the gate/up products (about three quarters of the layer's multiply-adds) were recomputed
for nothing. The replayed outputs are the same arrays, so the results are bit for bit those of a full rerun.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

Key = tuple[int, int]  # (id of the submodule, its n-th call in one forward)


@dataclass
class CallLog:
    """One forward's submodule calls: the descendants of each call, the kept outputs and what each target reuses."""

    inside: dict[Key, list[Key]] = field(default_factory=dict)  # key -> the calls made during it
    outputs: dict[Key, Any] = field(default_factory=dict)
    reuse: dict[int, list[Key]] = field(default_factory=dict)  # target id -> the outermost calls ended before it


def _swap(modules: Iterable[nn.Module], make_call) -> list[tuple[nn.Module, type]]:
    """Give each module a subclass whose ``__call__`` is ``make_call(base)``; the (module, base) pairs to restore."""
    saved, classes = [], {}
    for mod in modules:
        base = type(mod)
        if base not in classes:
            classes[base] = type(base.__name__, (base,), {"__call__": make_call(base)})
        saved.append((mod, base))
        mod.__class__ = classes[base]
    return saved


def _restore(saved: list[tuple[nn.Module, type]]) -> None:
    for mod, base in saved:
        mod.__class__ = base


def _submodules(root: nn.Module) -> list[nn.Module]:
    """Every distinct submodule of ``root`` (not ``root`` itself)."""
    seen, out = set(), []
    for _, mod in root.named_modules():
        if mod is not root and id(mod) not in seen:
            seen.add(id(mod))
            out.append(mod)
    return out


@contextlib.contextmanager
def record_calls(root: nn.Module, targets: Iterable[nn.Module]) -> Iterator[CallLog]:
    """Record the submodule calls of forwards of ``root`` run inside, keeping the outputs that a replay for any of
    ``targets`` reuses (the outermost calls that ended before the target's first call began).

    Outputs no target reuses are dropped as their enclosing call ends, so what stays is about what the forward
    holds anyway at each target's start. Run one forward inside."""
    log, counts, stack = CallLog(), defaultdict(int), []
    target_ids = {id(t) for t in targets}
    outer: list[Key] = []  # the ended calls not made inside another ended call, in order
    needed: set[Key] = set()

    def make_call(base: type):
        def call(self, *args, **kwargs):
            key = (id(self), counts[id(self)])
            counts[id(self)] += 1
            if id(self) in target_ids and id(self) not in log.reuse:
                log.reuse[id(self)] = list(outer)
                needed.update(outer)
            for k in stack:
                log.inside[k].append(key)
            log.inside[key] = []
            stack.append(key)
            try:
                out = base.__call__(self, *args, **kwargs)
            finally:
                stack.pop()
            log.outputs[key] = _fresh(out)  # not the caller's object, which it may assign into
            mine = set(log.inside[key])  # its own calls are covered by it from now on
            outer[:] = [k for k in outer if k not in mine] + [key]
            for k in mine - needed:
                log.outputs.pop(k, None)
            return out

        return call

    saved = _swap(_submodules(root), make_call)
    try:
        yield log
    finally:
        _restore(saved)
        for k in [k for k in log.outputs if k not in needed]:
            del log.outputs[k]
        arrays = [v for k in log.outputs for _, v in tree_flatten(log.outputs[k]) if isinstance(v, mx.array)]
        mx.eval(arrays)


def _fresh(out: Any) -> Any:
    """``out`` with each array a new array object on the same buffer (a reshape to its own shape, no copy): a model
    that assigns into an output in place (``y[..., i] = v`` changes that array object for every holder) leaves the
    recorded one as it was."""
    return tree_map(lambda v: v.reshape(v.shape) if isinstance(v, mx.array) else v, out)


@contextlib.contextmanager
def replay(root: nn.Module, log: CallLog, target: nn.Module) -> Iterator[None]:
    """Inside, a forward of ``root`` returns the recorded output of every call ``log`` keeps for ``target``
    (recorded by :func:`record_calls` with ``target`` among its targets) and runs the rest."""
    if id(target) not in log.reuse:
        raise ValueError("the forward recorded no call of this target")
    reuse = set(log.reuse[id(target)])
    counts: defaultdict[int, int] = defaultdict(int)

    def make_call(base: type):
        def call(self, *args, **kwargs):
            key = (id(self), counts[id(self)])
            counts[id(self)] += 1
            if key in reuse:
                for k in log.inside[key]:  # its own calls are skipped with it: their counts move on too
                    counts[k[0]] += 1
                return _fresh(log.outputs[key])
            return base.__call__(self, *args, **kwargs)

        return call

    saved = _swap(_submodules(root), make_call)
    try:
        yield
    finally:
        _restore(saved)
