"""Measurements: how much each candidate option hurts each tensor, in memory and on disk.

In memory a :class:`Measurement` holds one :class:`TensorRecord` per quantizable
tensor (its options with measured relative output error) and, for modules that
were measured jointly (ExLlamaV2's current form), :class:`JointGroup` records
whose options set every member at once.

On disk our JSON is a superset of ExLlamaV2's old per-linear form::

    {"format": "mlx_dq.measurement", "version": 1,
     "measurement": [{"key", "numel", "options": [{"desc", "bpw", "total_bits",
                      "err", "qparams", "mlx", ...}], "shape", "role", "importance"}],
     "groups": [...], "last_module_idx": N, "base_perplexity": P,
     "model": {...}, "calibration": {...}, "grid": ..., "versions": {...}, "tied": {...}}

``load_measurement`` also reads both ExLlamaV2 forms; how their options map to MLX
options is described in :mod:`mlx_dq.measure.exl2`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mlx_dq.errors import InputError
from mlx_dq.measure.exl2 import (
    dedupe_mapped,
    exl2_description,
    exl2_storage_bits,
    joint_bits_match,
    map_exl2_qparams,
    recover_joint_shapes,
    recover_shape,
)
from mlx_dq.names import layer_index, role_of
from mlx_dq.quant.options import QuantOption
from mlx_dq.safety import write_json_atomic

FORMAT_NAME = "mlx_dq.measurement"
FORMAT_VERSION = 1

# --------------------------------------------------------------------------- records
@dataclass
class OptionRecord:
    """One candidate option of one tensor and what it costs and hurts.

    ``total_bits`` are the exact MLX storage bits of ``option`` for the tensor
    (codes, scales, biases, permutation); ``err`` the relative output error
    ||X(Wq - W)^T||_F / ||X W^T||_F (``None`` for members of a joint option,
    whose error is only known for the whole module). ``damage`` is the option's
    end-to-end damage (KL divergence, nats) where it was measured directly (the
    head); the optimizer then uses it instead of ``importance * err**2``.
    """

    option: QuantOption
    bpw: float
    total_bits: int
    err: float | None
    weight_err: float | None = None
    clip: dict | None = None
    exl2_desc: str | None = None
    exl2_qparams: dict | None = None
    exl2_total_bits: int | None = None
    damage: float | None = None

    @property
    def desc(self) -> str:
        """The MLX option description."""
        return self.option.desc


@dataclass
class TensorRecord:
    """A quantizable tensor (keyed by its module path) and its measured options."""

    key: str
    shape: tuple[int, ...]
    numel: int = 0
    role: str = "default"
    importance: float = 1.0
    options: list[OptionRecord] = field(default_factory=list)
    group: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        if len(self.shape) < 2:
            raise InputError(f"tensor {self.key!r}: shape must be [out, in] or [E, out, in], got {self.shape}")
        n = math.prod(self.shape)
        if self.numel and self.numel != n:
            raise InputError(f"tensor {self.key!r}: numel {self.numel} does not match shape {self.shape}")
        self.numel = n

    def add_option(self, option: QuantOption, err: float | None, **kw: Any) -> OptionRecord:
        """Append a measured option, computing its exact MLX storage bits from the shape."""
        bits = option.storage_bits(self.shape)
        rec = OptionRecord(option, bits / self.numel, bits, err, **kw)
        self.options.append(rec)
        return rec

    def find(self, option: QuantOption | str) -> OptionRecord | None:
        """The record of ``option`` (or its description), if measured."""
        opt = QuantOption.parse(option) if isinstance(option, str) else option
        for rec in self.options:
            if rec.option == opt:
                return rec
        return None


@dataclass
class JointOption:
    """One option of a jointly measured module: an option for every member at once."""

    members: dict[str, OptionRecord]
    total_bits: int
    err: float
    accuracy: float | None = None
    exl2_total_bits: int | None = None


@dataclass
class JointGroup:
    """A module whose members were measured together (e.g. a whole attention block)."""

    key: str
    members: list[str]
    options: list[JointOption] = field(default_factory=list)
    importance: float = 1.0


@dataclass
class Measurement:
    """Everything a measurement says about a model: per-tensor and joint options plus provenance."""

    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    groups: dict[str, JointGroup] = field(default_factory=dict)
    base_perplexity: float | None = None  # the source's, on the importance rows (extra["importance"]["rows"])
    model: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    grid: Any = None
    versions: dict = field(default_factory=dict)
    last_module_idx: int | None = None
    tied: dict[str, str] = field(default_factory=dict)
    source_format: str = FORMAT_NAME
    extra: dict = field(default_factory=dict)

    def add_tensor(
        self, key: str, shape: Sequence[int], role: str | None = None, importance: float = 1.0
    ) -> TensorRecord:
        """Register a tensor (role guessed from its key when not given) and return its record."""
        rec = TensorRecord(key, tuple(shape), role=role or role_of(key), importance=importance)
        self.tensors[key] = rec
        return rec

    def tensor(self, key: str) -> TensorRecord:
        """The record of ``key``; KeyError naming the key when absent."""
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in the measurement") from None

    def numel(self, keys: Iterable[str] | None = None) -> int:
        """Total number of weights of ``keys`` (all tensors when None)."""
        keys = self.tensors if keys is None else keys
        return sum(self.tensors[k].numel for k in keys)

    def grouped_keys(self) -> set[str]:
        """Keys of tensors that belong to a joint group."""
        return {k for g in self.groups.values() for k in g.members}


# --------------------------------------------------------------------------- readers
def _need(obj: Mapping, name: str, where: str, path: str) -> Any:
    if not isinstance(obj, Mapping) or name not in obj:
        raise InputError.at(path, f"{where} lacks the field {name!r}")
    return obj[name]


def _read_json(path: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such measurement file") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (expected a JSON measurement)") from None
    if not text.strip():
        raise InputError(f"{path}: empty file (expected a JSON measurement)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        trunc = e.pos >= len(text.rstrip()) - 1
        kind = "truncated JSON (the file ends early)" if trunc else "not valid JSON"
        raise InputError(f"{path}: {kind}: {e.msg} at line {e.lineno} column {e.colno}") from None


def detect_format(data: Any) -> str:
    """Which measurement form a parsed JSON document is: ``mlx_dq``, ``exl2_v1``, ``exl2_v2`` or ``unknown``."""
    if not isinstance(data, dict):
        return "unknown"
    if data.get("format") == FORMAT_NAME:
        return "mlx_dq"
    m = data.get("measurement")
    if isinstance(m, list) and m and all(isinstance(r, dict) and "key" in r and "options" in r for r in m):
        return "exl2_v1"
    if isinstance(m, dict) and m and any(
        isinstance(v, list) and v and isinstance(v[0], dict) and "accuracy" in v[0] for v in m.values()
    ):
        return "exl2_v2"
    return "unknown"


def load_measurement(
    path: str | os.PathLike,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    exl2_map: str = "storage",
) -> Measurement:
    """Read a measurement file in our form or either ExLlamaV2 form (auto-detected).

    ``shapes`` ([out, in] per tensor key) overrides the shape recovery for ExLlamaV2
    files. Raises ValueError naming the file and the problem on anything else.
    """
    path = str(path)
    data = _read_json(path)
    kind = detect_format(data)
    readers = {"mlx_dq": lambda: _from_ours(data, path), "exl2_v1": lambda: _from_exl2_v1(data, path, shapes or {}, exl2_map),
               "exl2_v2": lambda: _from_exl2_v2(data, path, shapes or {}, exl2_map)}
    if kind in readers:
        try:
            return validate_measurement(readers[kind](), path)
        except ValueError as e:
            if str(e).startswith(path):
                raise
            raise InputError.at(path, f"malformed measurement: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError, OverflowError, ZeroDivisionError) as e:
            raise InputError.at(path, f"malformed measurement: {type(e).__name__}: {e}") from None
    keys = sorted(data)[:8] if isinstance(data, dict) else type(data).__name__
    raise InputError(
        f"{path}: not a measurement file (expected our 'mlx_dq.measurement' JSON or an ExLlamaV2 "
        f"measurement with a 'measurement' list or dict; found {keys})"
    )


def _from_exl2_v1(data: dict, path: str, shapes: Mapping, mode: str) -> Measurement:
    m = Measurement(source_format="exl2_v1", base_perplexity=data.get("base_perplexity"))
    m.extra["exl2_last_module_idx"] = data.get("last_module_idx")
    layers = set()
    for i, r in enumerate(data["measurement"]):
        key = _need(r, "key", f"measurement[{i}]", path)
        where = f"measurement[{i}] ({key!r})"
        numel = int(_need(r, "numel", where, path))
        opts = _need(r, "options", where, path)
        if not isinstance(opts, list) or not opts:
            raise InputError.at(path, f"{where} has no options")
        for j, o in enumerate(opts):
            for f in ("desc", "total_bits", "err", "qparams"):
                _need(o, f, f"{where} option {j}", path)
        shape = tuple(shapes[key]) if key in shapes else recover_shape(key, numel, opts, path)
        rec = TensorRecord(key, shape, numel, role_of(key))
        recs = []
        for o in opts:
            opt = map_exl2_qparams(o["qparams"], shape[-1], mode)
            bits = opt.storage_bits(shape)
            recs.append(
                OptionRecord(opt, bits / rec.numel, bits, float(o["err"]), exl2_desc=o["desc"],
                             exl2_qparams=o["qparams"], exl2_total_bits=round(float(o["total_bits"])))
            )
        rec.options = dedupe_mapped(recs, lambda r: r.total_bits, lambda r: r.exl2_total_bits, lambda r: r.err,
                              lambda r: r.option)
        m.tensors[key] = rec
        layers.update(x for x in [layer_index(key)] if x is not None)
    m.last_module_idx = max(layers) if layers else None
    return m


def _from_exl2_v2(data: dict, path: str, shapes: Mapping, mode: str) -> Measurement:
    m = Measurement(source_format="exl2_v2", base_perplexity=data.get("base_perplexity"))
    m.extra["exl2_last_module_idx"] = data.get("last_module_idx")
    hidden: int | None = None
    layers = set()
    modules = data["measurement"]
    # MLP blocks first: they pin the hidden size cheaply for the attention search
    order = sorted(modules, key=lambda k: 0 if isinstance(modules[k], list) and modules[k]
                   and "down_proj" in modules[k][0] else 1)
    recovered: dict[str, dict] = {}
    for mod in order:
        opts = modules[mod]
        if opts is None:
            m.extra.setdefault("exl2_unmeasured", []).append(mod)
            continue
        if not isinstance(opts, list) or not opts:
            raise InputError.at(path, f"module {mod!r} has no options")
        for j, o in enumerate(opts):
            _need(o, "accuracy", f"module {mod!r} option {j}", path)
            _need(o, "total_bits", f"module {mod!r} option {j}", path)
        members = [k for k, v in opts[0].items() if isinstance(v, dict)]
        if not members:
            raise InputError.at(path, f"module {mod!r} option 0 names no member linears")
        full = {k: f"{mod}.{k}" for k in members}
        if all(full[k] in shapes for k in members):
            sh = {k: tuple(shapes[full[k]]) for k in members}
        else:  # layers of one model share shapes: try the last match of the same members first
            sh = next((prev for prev in reversed(recovered.values())
                       if sorted(prev) == sorted(members) and joint_bits_match(prev, opts)), None)
            sh = sh or recover_joint_shapes(mod, opts, hidden, path)
        if hidden is None and "down_proj" in sh:
            hidden = sh["down_proj"][0]
        recovered[mod] = sh
    for mod, opts in modules.items():
        if mod not in recovered:
            continue
        sh = recovered[mod]
        members = list(sh)
        group = JointGroup(mod, [f"{mod}.{k}" for k in members])
        for k in members:
            key = f"{mod}.{k}"
            m.tensors[key] = TensorRecord(key, sh[k], role=role_of(key), group=mod)
        joint = []
        for j, o in enumerate(opts):
            recs = {}
            for k in members:
                qp = _need(o, k, f"module {mod!r} option {j}", path)
                opt = map_exl2_qparams(qp, sh[k][1], mode)
                bits = opt.storage_bits(sh[k])
                recs[f"{mod}.{k}"] = OptionRecord(
                    opt, bits / math.prod(sh[k]), bits, None, exl2_desc=exl2_description(qp), exl2_qparams=qp,
                    exl2_total_bits=exl2_storage_bits(sh[k][1], sh[k][0], qp, 32),
                )
            acc = float(o["accuracy"])
            joint.append(JointOption(recs, sum(r.total_bits for r in recs.values()), 1.0 - acc, acc,
                                     int(o["total_bits"])))
        group.options = dedupe_mapped(joint, lambda r: r.total_bits, lambda r: r.exl2_total_bits, lambda r: r.err,
                                lambda r: tuple(x.option for x in r.members.values()))
        m.groups[mod] = group
        layers.update(x for x in [layer_index(mod)] if x is not None)
    m.last_module_idx = max(layers) if layers else None
    return m


# --------------------------------------------------------------------------- our form
def _opt_to_json(rec: OptionRecord) -> dict:
    d = {
        "desc": rec.exl2_desc or rec.option.desc,
        "bpw": rec.bpw,
        "total_bits": rec.total_bits,
        "err": rec.err,
        "qparams": rec.exl2_qparams or rec.option.to_exl2_qparams(),
        "mlx": rec.option.desc,
    }
    for name in ("weight_err", "clip", "exl2_desc", "exl2_total_bits", "damage"):
        v = getattr(rec, name)
        if v is not None:
            d[name] = v
    if rec.exl2_qparams is not None:
        d["exl2_qparams"] = rec.exl2_qparams
    return d


def _check_types(d: Mapping, where: str, path: str, ints: Iterable[str] = (), numbers: Iterable[str] = (),
                 strings: Iterable[str] = ()) -> None:
    """Strict JSON types for the fields a reader uses (no numbers as strings, no booleans as numbers)."""
    from mlx_dq.safety import finite_number

    for f in ints:
        v = d.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise InputError.at(path, f"{where}: {f} must be an integer, got {v!r}")
    for f in numbers:
        if d.get(f) is not None:
            try:
                finite_number(d[f], f)
            except ValueError as e:
                raise InputError.at(path, f"{where}: {e}") from None
    for f in strings:
        v = d.get(f)
        if v is not None and not isinstance(v, str):
            raise InputError.at(path, f"{where}: {f} must be a string, got {v!r}")


def _opt_from_json(d: Mapping, where: str, path: str) -> OptionRecord:
    _check_keys(d, _OPTION_KEYS, where, path)
    for f in ("mlx", "bpw", "total_bits", "err"):
        _need(d, f, where, path)
    _check_types(d, where, path, ints=("total_bits",), numbers=("bpw", "err", "damage"), strings=("mlx",))
    try:
        opt = QuantOption.parse(d["mlx"])
    except ValueError as e:
        raise InputError.at(path, f"{where}: {e}") from None
    return OptionRecord(
        opt, float(d["bpw"]), int(d["total_bits"]), None if d["err"] is None else float(d["err"]),
        weight_err=d.get("weight_err"), clip=d.get("clip"), exl2_desc=d.get("exl2_desc"),
        exl2_qparams=d.get("exl2_qparams"), exl2_total_bits=d.get("exl2_total_bits"),
        damage=None if d.get("damage") is None else float(d["damage"]),
    )


def _tensor_head(t: TensorRecord) -> dict:
    d = {"key": t.key, "numel": t.numel, "shape": list(t.shape), "role": t.role, "importance": t.importance}
    if t.group is not None:
        d["group"] = t.group
    if t.extra:
        d["extra"] = t.extra
    return d


def measurement_to_json(m: Measurement) -> dict:
    """Our JSON document for ``m`` (ExLlamaV2 old-form fields plus ours)."""
    grouped = m.grouped_keys()
    doc: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
    doc["measurement"] = [
        {**_tensor_head(t), "options": [_opt_to_json(o) for o in t.options]}
        for t in m.tensors.values() if t.key not in grouped
    ]
    doc["groups"] = [
        {
            "key": g.key,
            "importance": g.importance,
            "tensors": [_tensor_head(m.tensors[k]) for k in g.members],
            "options": [
                {"err": o.err, "accuracy": o.accuracy, "total_bits": o.total_bits,
                 "exl2_total_bits": o.exl2_total_bits,
                 "members": {k: _opt_to_json(r) for k, r in o.members.items()}}
                for o in g.options
            ],
        }
        for g in m.groups.values()
    ]
    doc.update(
        last_module_idx=m.last_module_idx, base_perplexity=m.base_perplexity, model=m.model,
        calibration=m.calibration, grid=m.grid, versions=m.versions, tied=m.tied,
        source_format=m.source_format, extra=m.extra,
    )
    return doc


def _tensor_from_json(r: Mapping, where: str, path: str) -> TensorRecord:
    _check_keys(r, _TENSOR_KEYS, where, path)
    key = _need(r, "key", where, path)
    if not isinstance(key, str) or not key:
        raise InputError.at(path, f"{where}: key must be a non-empty string, got {key!r}")
    if not isinstance(r.get("role", ""), str) or not isinstance(r.get("group", ""), (str, type(None))):
        raise InputError.at(path, f"{where} ({key!r}): role and group must be strings")
    _check_types(r, f"{where} ({key!r})", path, ints=("numel",), numbers=("importance",))
    shape = _need(r, "shape", f"{where} ({key!r})", path)
    if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
        raise InputError.at(path, f"{where} ({key!r}): shape must be a list of integers, got {shape!r}")
    try:
        return TensorRecord(key, tuple(shape), int(r.get("numel", 0)), r.get("role", role_of(key)),
                            float(r.get("importance", 1.0)), group=r.get("group"), extra=r.get("extra", {}))
    except (TypeError, ValueError) as e:
        raise InputError.at(path, f"{where} ({key!r}): {e}") from None


def _from_ours(data: dict, path: str) -> Measurement:
    if data.get("version") != FORMAT_VERSION:
        raise InputError.at(path, f"unsupported {FORMAT_NAME} version {data.get('version')!r} "
                                  f"(expected {FORMAT_VERSION})")
    _check_keys(data, _TOP_KEYS, "the document", path)
    for name in ("model", "calibration", "versions", "tied", "extra"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise InputError.at(path, f"{name!r} must be an object, got {type(data[name]).__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (data.get("tied") or {}).items()):
        raise InputError.at(path, "'tied' must map tensor names to tensor names")
    for name in ("last_module_idx", "base_perplexity"):
        v = data.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise InputError.at(path, f"{name!r} must be a finite number or null, got {v!r}")
    m = Measurement(
        base_perplexity=data.get("base_perplexity"), model=data.get("model") or {},
        calibration=data.get("calibration") or {}, grid=data.get("grid"), versions=data.get("versions") or {},
        last_module_idx=data.get("last_module_idx"), tied=data.get("tied") or {},
        source_format=data.get("source_format", FORMAT_NAME), extra=data.get("extra") or {},
    )
    entries = _need(data, "measurement", "the document", path)
    if not isinstance(entries, list):
        raise InputError.at(path, "'measurement' must be a list of tensor records")
    for i, r in enumerate(entries):
        t = _tensor_from_json(r, f"measurement[{i}]", path)
        opts = _need(r, "options", f"measurement[{i}] ({t.key!r})", path)
        t.options = [_opt_from_json(o, f"measurement[{i}] ({t.key!r}) option {j}", path) for j, o in enumerate(opts)]
        m.tensors[t.key] = t
    for i, g in enumerate(data.get("groups") or []):
        gkey = _need(g, "key", f"groups[{i}]", path)
        where = f"groups[{i}] ({gkey!r})"
        members = []
        for j, r in enumerate(_need(g, "tensors", where, path)):
            t = _tensor_from_json(r, f"{where} tensor {j}", path)
            m.tensors[t.key] = t
            members.append(t.key)
        group = JointGroup(gkey, members, importance=float(g.get("importance", 1.0)))
        for j, o in enumerate(_need(g, "options", where, path)):
            w = f"{where} option {j}"
            mem = _need(o, "members", w, path)
            group.options.append(JointOption(
                {k: _opt_from_json(v, f"{w} member {k!r}", path) for k, v in mem.items()},
                int(_need(o, "total_bits", w, path)), float(_need(o, "err", w, path)),
                o.get("accuracy"), o.get("exl2_total_bits"),
            ))
        m.groups[gkey] = group
    return m


def save_measurement(m: Measurement, path: str | os.PathLike) -> None:
    """Write ``m`` as our JSON, atomically (temp file in the same folder, then os.replace)."""
    write_json_atomic(measurement_to_json(m), path)


# --------------------------------------------------------------------------- validation
_TOP_KEYS = {"format", "version", "measurement", "groups", "last_module_idx", "base_perplexity", "model",
             "calibration", "grid", "versions", "tied", "source_format", "extra"}
_TENSOR_KEYS = {"key", "numel", "shape", "role", "importance", "group", "extra", "options"}
_OPTION_KEYS = {"desc", "bpw", "total_bits", "err", "qparams", "mlx", "weight_err", "clip", "exl2_desc",
                "exl2_total_bits", "damage", "exl2_qparams"}


def _check_keys(obj: Any, allowed: set, where: str, path: str) -> None:
    if not isinstance(obj, Mapping):
        raise InputError.at(path, f"{where} must be an object, got {type(obj).__name__}")
    extra = sorted(str(k) for k in obj if k not in allowed)
    if extra:
        raise InputError.at(path, f"{where} has unknown field(s) {extra[:3]} (a file of another tool or version?)")


def _check_option(r: OptionRecord, where: str, path: str) -> None:
    from mlx_dq.safety import finite_number

    try:
        if r.err is not None:
            finite_number(r.err, "err", minimum=0.0)
        if r.damage is not None:
            finite_number(r.damage, "damage", minimum=0.0)
        finite_number(r.bpw, "bpw", minimum=0.0)
        if r.total_bits < 0:
            raise InputError(f"total_bits must be >= 0, got {r.total_bits}")
    except ValueError as e:
        raise InputError.at(path, f"{where} ({r.desc}): {e}") from None


def _check_bits(r: OptionRecord, shape: tuple[int, ...], where: str, path: str) -> None:
    if not r.option.fits(shape[-1]):
        raise InputError.at(path, f"{where}: option {r.desc} does not fit {shape[-1]} inputs")
    if r.total_bits != r.option.storage_bits(shape):
        raise InputError.at(path, f"{where}: total_bits {r.total_bits} are not the storage of {r.desc} "
                                  f"at shape {list(shape)}")
    if abs(r.bpw - r.total_bits / math.prod(shape)) > 1e-6 * max(r.bpw, 1.0):
        raise InputError.at(path, f"{where}: bpw {r.bpw} does not match total_bits / weights")


def validate_measurement(m: Measurement, path: str) -> Measurement:
    """Refuse measurements the optimizer cannot trust: errors and importances must be finite and non-negative."""
    from mlx_dq.safety import finite_number

    for t in m.tensors.values():
        where = f"tensor {t.key!r}"
        if any(d <= 0 for d in t.shape):
            raise InputError.at(path, f"{where}: shape {list(t.shape)} has a non-positive dimension")
        try:
            finite_number(t.importance, "importance", minimum=0.0)
        except ValueError as e:
            raise InputError.at(path, f"{where}: {e}") from None
        if t.group is None and not t.options:
            raise InputError.at(path, f"{where} has no options")
        for r in t.options:
            _check_option(r, where, path)
            _check_bits(r, t.shape, where, path)
    for g in m.groups.values():
        where = f"module {g.key!r}"
        try:
            finite_number(g.importance, "importance", minimum=0.0)
        except ValueError as e:
            raise InputError.at(path, f"{where}: {e}") from None
        for k in g.members:
            if k not in m.tensors:
                raise InputError.at(path, f"{where} names a member {k!r} that has no tensor record")
        if not g.options:
            raise InputError.at(path, f"{where} has no options")
        for j, o in enumerate(g.options):
            try:
                finite_number(o.err, "err", minimum=0.0)
            except ValueError as e:
                raise InputError.at(path, f"{where} option {j}: {e}") from None
            if set(o.members) != set(g.members):
                raise InputError.at(path, f"{where} option {j} does not set exactly the module's members")
            for k, r in o.members.items():
                _check_option(r, f"{where} option {j}", path)
                _check_bits(r, m.tensors[k].shape, f"{where} option {j} member {k!r}", path)
    return m


def measurement_complete(m: Measurement) -> bool:
    """Whether ``m`` covers the whole model (our measurements say so; ExLlamaV2 files are taken as complete)."""
    if m.source_format != FORMAT_NAME or "complete" not in m.extra:
        return True
    return m.extra.get("complete") is True
