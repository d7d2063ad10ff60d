"""The output folder: safetensors shards, config.json, the manifest, the model file, and publishing it.

A conversion builds its folder in a temporary sibling (:func:`prepare_output`)
and renames it into place when complete (:func:`publish`), so an interrupted
convert never leaves a folder that looks complete. This module owns the file
names and formats of that folder (``mlx_dq.json`` and its schema, the model
file shim ``mlx_dq_model.py``) and reads them back (:func:`read_manifest`,
:func:`verify_model_file`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_dq.errors import InputError, IntegrityError
from mlx_dq.formats.facts import packing_facts
from mlx_dq.model.sources import recorded_spec
from mlx_dq.names import MANIFEST_NAME, MANIFEST_SCHEMA, MODEL_FILE, default_bits_group
from mlx_dq.plan.plan import Plan
from mlx_dq.quant.affine import (
    QuantizedTensor,
    exact_sums,
    output_error_sums,
    relative_error,
)
from mlx_dq.quant.dispatch import row_blocks
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.rowsplit import ID_BITS
from mlx_dq.safety import (
    finite_number,
    guard_output_folder,
    make_partial_folder,
    publish_folder,
)

MANIFEST_VERSION = 2  # 2: module "bits" -> "storage_bits", "dense_bytes" -> "kept16_bytes", facts added
DEFAULT_SHARD_BYTES = 4 << 30

MODEL_FILE_TEXT = '''"""mlx-lm model file for an mlx-dq output with mixed-proportion layers.

mlx-lm loads it with ``trust_remote_code=True`` (CLIs: ``--trust-remote-code``).
It wraps mlx-lm's own model class for this folder's ``model_type`` and swaps in
mlx-dq's mixed layers listed under ``mlx_dq.mixed`` in config.json.
"""

import json
from pathlib import Path

try:
    from mlx_dq.loader import mixed_model_classes
except ImportError as e:  # pragma: no cover - depends on the user's environment
    raise ImportError("this model has mixed-proportion layers: install mlx-dq (pip install mlx-dq)") from e

_CONFIG = json.loads((Path(__file__).parent / "config.json").read_text())
Model, ModelArgs = mixed_model_classes(_CONFIG)
'''


def tensor_arrays(path: str, qt: QuantizedTensor, dtype: mx.Dtype) -> dict[str, mx.array]:
    """The arrays stored for module ``path`` quantized as ``qt`` (names as the loading layer expects).

    Scales and biases keep the 16-bit dtype they were quantized with (the codes
    were rounded against exactly those values); ``dtype`` applies to 16-bit tensors.
    """
    if qt.fp is not None:
        return {f"{path}.weight": qt.fp.astype(dtype)}
    if not qt.option.is_mixed:
        w, s, b = qt.parts[0]
        return {f"{path}.weight": w, f"{path}.scales": s, f"{path}.biases": b}
    out = {}
    for i, (w, s, b) in enumerate(qt.parts):
        out[f"{path}.weight_{i}"] = w
        out[f"{path}.scales_{i}"] = s
        out[f"{path}.biases_{i}"] = b
    out[f"{path}.perm"] = mx.array(qt.perm)
    return out


_SAFETENSORS_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
                       mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.int8: "I8",
                       mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.bool_: "BOOL"}


class ShardWriter:
    """Writes arrays into numbered safetensors shards as they come, then names them like mlx-lm does.

    Each array's bytes go to disk when added (a shard's data file; the header and the data are joined when
    the shard is full), so memory holds one part's arrays, not a whole shard: before, a 4 GiB shard of
    quantized layers stayed in memory until written, on top of the last layer's peak.
    """

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder = folder
        self.max_bytes = max_bytes
        self.entries: dict[str, dict[str, Any]] = {}  # the current shard's header
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.nbytes = 0
        self._data: Any = None
        self._names: set[str] = set()

    def _data_path(self) -> Path:
        return self.folder / f"shard-{len(self.files):05d}.data"

    def add(self, arrays: dict[str, mx.array]) -> None:
        """Write ``arrays`` to the current shard's data; a new shard starts when this one would grow past
        ``max_bytes``."""
        if not arrays:
            return
        size = sum(a.nbytes for a in arrays.values())
        if self.entries and self.pending_bytes + size > self.max_bytes:
            self._flush()
        if self._data is None:
            self._data = open(self._data_path(), "wb")
        for name, a in arrays.items():
            if name in self._names:
                raise ValueError(f"tensor {name!r} written twice")
            self._names.add(name)
            kind = _SAFETENSORS_DTYPES[a.dtype]
            host = np.ascontiguousarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
            self._data.write(memoryview(host.reshape(-1)).cast("B") if host.size else b"")
            self.entries[name] = {"dtype": kind, "shape": [int(d) for d in a.shape],
                                  "data_offsets": [self.pending_bytes, self.pending_bytes + int(a.nbytes)]}
            self.pending_bytes += int(a.nbytes)
        self._data.flush()
        self.nbytes += size

    def _flush(self) -> None:
        if self._data is None:
            return
        self._data.close()
        data, path = self._data_path(), self.folder / f"shard-{len(self.files):05d}.safetensors"
        header = json.dumps({"__metadata__": {"format": "mlx"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        with open(path, "wb") as out, open(data, "rb") as src:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(src, out, 16 << 20)
        data.unlink()
        self.files.append((path, sorted(self.entries)))
        self.entries, self.pending_bytes, self._data = {}, 0, None

    def close(self) -> list[Path]:
        """Write the last shard, rename shards (``model.safetensors`` or ``model-0000i-of-0000n``), write the index."""
        self._flush()
        n = len(self.files)
        out, weight_map = [], {}
        for i, (path, keys) in enumerate(self.files):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / name)
            out.append(self.folder / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return out


def prepare_output(out: Path, force: bool) -> Path:
    """Check ``out`` may be written and return a fresh temporary sibling folder to build it in.

    Leftover ``.NAME.partial-PID`` folders of killed conversions in the same parent are removed first.
    """
    guard_output_folder(out, force)
    return make_partial_folder(out)


def publish(tmp: Path, out: Path) -> None:
    """Move the finished folder into place (replacing an old one only now, when the new one is complete)."""
    publish_folder(tmp, out)


def tensor_record(qt: QuantizedTensor, gram: mx.array | None, w: mx.array | None, arrays: dict[str, mx.array],
                  dtype: str = "float16", energy: mx.array | None = None) -> dict:
    """The manifest record of one quantized tensor (``storage_bits``: codes + scales + biases + permutation);
    ``energy``: the tensor's output energy per row (``w_i G w_i^T``) when known."""
    opt = qt.option
    err = _output_error(qt, w, gram, energy) if gram is not None and not opt.keep16 else None
    return {
        "option": opt.desc,
        "shape": list(qt.shape),
        "numel": int(math.prod(qt.shape)),
        "storage_bits": int(opt.storage_bits(qt.shape)),
        "bpw": opt.bpw(qt.shape),
        "packing": packing_facts(opt, qt.shape, dtype),
        "bytes": int(sum(a.nbytes for a in arrays.values())),
        "err": err,
        "clip": {k: qt.stats[k] for k in ("clipped_fraction", "clip_improvement") if k in qt.stats},
    }


def _output_error(qt: QuantizedTensor, w: mx.array, gram: mx.array, energy: mx.array | None = None) -> float:
    """:func:`mlx_dq.quant.affine.output_error` of the stored codes, summed over blocks of output rows (a large head
    otherwise needs several float32 copies of itself: 5 GB of temporaries at 151,936 x 896). When the quantizer
    knows the rows' squared errors (``qt.out_sq``, GPTQ), only the reference sum is multiplied out here, and not
    even that when the rows' output ``energy`` is known (both: nothing is multiplied)."""
    known = qt.out_sq
    num = 0.0 if known is None else float(np.sum(known, dtype=np.float64))
    den = None if energy is None else float(np.sum(np.asarray(energy, dtype=np.float64)))
    if known is not None and den is not None:
        return relative_error(num, den)
    ref = 0.0
    g = gram.astype(mx.float32)
    for sl in row_blocks(w.shape) or [slice(None)]:
        if known is None:
            n, d = output_error_sums(w[..., sl, :], qt.rows(sl).dequantize(mx.float32), g)
            num += n
        else:
            w32 = w[..., sl, :].astype(mx.float32)
            (d,) = exact_sums((w32 @ g) * w32)
        ref += d
    return relative_error(num, ref if den is None else den)


def output_config(src: dict, qconf: dict[str, dict], mixed: dict[str, dict], dtype: str = "float16",
                  numel: dict[str, int] | None = None, splits: dict[str, dict] | None = None) -> dict:
    """config.json for the output: source config + mlx-lm ``quantization`` (+ ``model_file``, mixed layers and
    tables with frequent-token rows, ``splits``: path -> {"rows": hot rows}).

    The folder-wide default bits and group size are the most common by weights
    (``numel`` per module), the same rule as the plan's MLX-config export.
    """
    config = {k: v for k, v in src.items() if k not in ("quantization", "quantization_config", "model_file")}
    config["torch_dtype"] = dtype
    if qconf:
        numel = numel or {}
        bits, gs = default_bits_group((e["bits"], e["group_size"], numel.get(k, 1)) for k, e in qconf.items())
        config["quantization"] = {"group_size": gs, "bits": bits, "mode": "affine", **dict(sorted(qconf.items()))}
    if mixed or splits:
        config["model_file"] = MODEL_FILE
        config["mlx_dq"] = {"mixed": dict(sorted(mixed.items()))}
        if splits:
            config["mlx_dq"]["row_split"] = dict(sorted(splits.items()))
    return config


@dataclass(frozen=True)
class WrittenTensors:
    """What a folder's shards hold, as its manifest accounts for it.

    ``records``: path -> the tensor's record (:func:`tensor_record`); ``mixed``: the mixed-proportion modules;
    ``files``: the shard files; ``other_bytes``: the arrays that are no quantized tensor (norms, biases, hot ids);
    ``array_bytes``: every array written; ``splits``: the tables with frequent-token rows (path -> {"rows": n}).
    """

    records: dict
    mixed: dict
    files: list[Path]
    other_bytes: int
    array_bytes: int
    splits: dict[str, dict] | None = None


def build_manifest(source: Any, plan: Plan, written: WrittenTensors, config: dict, version: str, calib: dict,
                   settings: dict, seconds: float) -> dict:
    """The accounting and provenance record written as ``mlx_dq.json``.

    A table with frequent-token rows (``written.splits``) has one record per part (``<path>.hot``,
    ``<path>.cold``); its hot ids are counted in ``other_bytes`` and in the average bits.
    """
    import mlx_lm

    records, mixed, files = written.records, written.mixed, written.files
    other_bytes, array_bytes, splits = written.other_bytes, written.array_bytes, written.splits or {}
    id_bits = {p: ID_BITS * int(v["rows"]) for p, v in splits.items()}
    quant = {k: r for k, r in records.items() if r["option"] != "16bit"}
    q_bits = sum(r["storage_bits"] for r in records.values())  # the ids are in other_bytes
    numel = sum(r["numel"] for r in records.values())
    budget_keys = {e.key for e in plan.tensors if e.scope == "budget"}
    budget_keys |= {f"{p}.{part}" for p in splits if p in budget_keys for part in ("hot", "cold")}
    b_bits = sum(r["storage_bits"] for k, r in records.items() if k in budget_keys)
    b_bits += sum(b for p, b in id_bits.items() if p in budget_keys)
    b_numel = sum(r["numel"] for k, r in records.items() if k in budget_keys)
    disk = sum(f.stat().st_size for f in files)
    packed = sum(r["storage_bits"] for r in quant.values()) // 8
    tied = {}
    tables = list(records) + list(splits)
    if config.get("tie_word_embeddings") or any(k.endswith("embed_tokens") for k in tables) and not any(
        k.endswith("lm_head") for k in tables
    ):
        emb = [k for k in tables if k.endswith("embed_tokens")]
        if emb:
            tied = {"lm_head": emb[0]}
    return {
        "schema": MANIFEST_SCHEMA,
        "schema_version": MANIFEST_VERSION,
        "mlx_dq": version,
        "mlx_lm": getattr(mlx_lm, "__version__", "unknown"),
        "mlx": mx.__version__,
        "accounting": {
            "packed_bytes": int(packed),
            "kept16_bytes": int(sum(r["bytes"] for k, r in records.items() if k not in quant)),
            "predicted_tensor_bytes": int(q_bits // 8),
            "other_bytes": int(other_bytes),
            "predicted_bytes": int(q_bits // 8 + other_bytes),
            "array_bytes": int(array_bytes),
            "weights_on_disk_bytes": int(disk),
            "quantized_elements": int(sum(r["numel"] for r in quant.values())),
            "elements": int(numel),
            "average_bits": b_bits / b_numel if b_numel else None,
            "average_bits_all": (q_bits + sum(id_bits.values())) / numel if numel else None,
            "target_bpw": plan.target_bpw,
        },
        "tied": tied,
        "expert_banks": sorted(k for k, r in records.items() if len(r["shape"]) == 3),
        "mixed_modules": sorted(mixed),
        "row_split_modules": dict(sorted(splits.items())),
        "loading": (
            "mlx_lm.load(path, trust_remote_code=True) / --trust-remote-code, or mlx_dq.load(path)"
            if mixed or splits else "mlx_lm.load(path) / mlx_lm.generate --model path"
        ),
        "provenance": {
            "source": {"spec": recorded_spec(source), "kind": source.kind, "fingerprint": source.fingerprint(),
                       "model_type": source.config.get("model_type")},
            "plan": {"target_bpw": plan.target_bpw, "achieved_bpw": plan.achieved_bpw,
                     "objective": plan.objective, "lower_bound": plan.lower_bound, "gap": plan.gap,
                     "method": plan.method, "source": plan.source},
            "calibration": calib,
            "settings": settings,
            "quantization_seconds": round(seconds, 2),
        },
        "modules": dict(sorted(records.items())),
    }


# --------------------------------------------------------------------------
# reading a folder back
# --------------------------------------------------------------------------
def read_manifest(folder: str | Path, missing_ok: bool = False) -> dict | None:
    """The manifest ``mlx_dq.json`` of an output folder.

    ValueError when it is corrupt or foreign, and when it is missing unless
    ``missing_ok`` (then None: a folder that is not an mlx-dq output).
    """
    path = Path(folder) / MANIFEST_NAME
    if not path.exists():
        if missing_ok:
            return None
        raise InputError(f"{folder} has no {MANIFEST_NAME}: not an mlx-dq output folder")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise IntegrityError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA or "modules" not in data:
        raise IntegrityError(f"{path} is not an mlx-dq manifest")
    return data


def _source_candidates(folder: Path, spec: str, kind: Any) -> list[str]:
    """Where a recorded source spec may be: itself, or (a relative local path from an older manifest) relative to
    the output folder's parent, where ``convert --model SPEC -o FOLDER`` was most often run, and to this folder."""
    from mlx_dq.model.sources import recorded_as_path

    if not recorded_as_path(kind, spec) or Path(spec).expanduser().is_absolute():
        return [spec]
    out = []
    for base in (folder.resolve().parent, Path.cwd()):
        c = str((base / spec).resolve())
        if c not in out:
            out.append(c)
    return out


def recorded_source(folder: str | Path, manifest: dict | None = None, flag: str = "--model") -> str | None:
    """The source model spec ``folder`` was made from, checked against the fingerprint its manifest records.

    None when the manifest records no source. InputError when the recorded source cannot be
    found or is another model (different fingerprint): a comparison with it would be wrong.
    """
    from mlx_dq.model.sources import resolve

    folder = Path(folder)
    manifest = read_manifest(folder, missing_ok=True) if manifest is None else manifest
    rec = ((manifest or {}).get("provenance") or {}).get("source") or {}
    spec = rec.get("spec") if isinstance(rec, dict) else None
    if not spec:
        return None
    if not isinstance(spec, str):
        raise IntegrityError.at(folder / MANIFEST_NAME, f"provenance.source.spec must be a string, got {spec!r}")
    want, seen, missing = rec.get("fingerprint"), [], []
    for cand in _source_candidates(folder, spec, rec.get("kind")):
        try:
            found = resolve(cand).fingerprint()
        except (ValueError, OSError) as e:
            missing.append(f"{cand} ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            continue
        if not want or found == want:
            return cand
        seen.append(f"{cand} has fingerprint {found[:16]}")
    if seen:
        raise InputError(f"{folder} was made from {spec} with fingerprint {str(want)[:16]}, but "
                         f"{'; '.join(seen)}: another model; give the right source with {flag}")
    raise InputError(f"{folder} was made from {spec}, which cannot be found: {'; '.join(missing)}; "
                     f"give the source with {flag}")


def check_manifest(manifest: dict, path: Path) -> None:
    """ValueError unless the fields the bit map and the checks read have the right types and finite values."""
    def number(v: Any, where: str, nullable: bool = False) -> None:
        if v is None and nullable:
            return
        try:
            finite_number(v, where, minimum=0.0)
        except ValueError as e:
            raise IntegrityError.at(path, str(e)) from None

    modules = manifest.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise IntegrityError.at(path, "'modules' must be a non-empty object of module records")
    for name, rec in modules.items():
        where = f"module {name!r}"
        if not isinstance(rec, dict):
            raise IntegrityError.at(path, f"{where} must be an object")
        option = rec.get("option")
        if not isinstance(option, str):
            raise IntegrityError.at(path, f"{where}: option must be a string, got {option!r}")
        try:
            QuantOption.parse(option)
        except (ValueError, TypeError, AttributeError) as e:
            raise IntegrityError.at(path, f"{where}: {e}") from None
        shape = rec.get("shape")
        if not isinstance(shape, list) or len(shape) < 2 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise IntegrityError.at(path, f"{where}: shape must be a list of positive integers, got {shape!r}")
        bits_field = "storage_bits" if "storage_bits" in rec else "bits"  # named storage_bits from version 2
        for f in ("bpw", bits_field, "numel", "bytes"):
            number(rec.get(f), f"{where}: {f}")
        if rec["numel"] != math.prod(shape):
            raise IntegrityError.at(path, f"{where}: numel {rec['numel']} does not match shape {shape}")
        opt = QuantOption.parse(option)
        if rec[bits_field] != opt.storage_bits(shape) or abs(rec["bpw"] - opt.bpw(shape)) > 1e-6:
            raise IntegrityError.at(path, f"{where}: {bits_field}/bpw {rec[bits_field]}/{rec['bpw']} "
                                          f"are not the storage of {option}")
    acc = manifest.get("accounting", {})
    if not isinstance(acc, dict):
        raise IntegrityError.at(path, "'accounting' must be an object")
    for k, v in acc.items():
        number(v, f"accounting.{k}", nullable=True)
    if not isinstance(manifest.get("tied", {}), dict):
        raise IntegrityError.at(path, "'tied' must be an object")


def verify_model_file(folder: str | os.PathLike) -> str:
    """Check that the only code a folder asks mlx-lm to import is mlx-dq's own shim; returns what was found.

    IntegrityError when config.json's ``model_file`` names anything but mlx-dq's model
    file, or when that file differs by one byte from the shim mlx-dq writes
    (``trust_remote_code`` would import it). A folder without ``model_file`` runs
    no folder code.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{folder} is not a model folder (no config.json)") from None
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{cfg_path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise IntegrityError(f"{cfg_path} is not a JSON object")
    if "model_file" not in config:
        return f"{folder}: config.json names no model_file: mlx-lm runs no code from this folder"
    name = config["model_file"]
    if name != MODEL_FILE:
        raise IntegrityError(f"{cfg_path}: model_file is {name!r}, not mlx-dq's {MODEL_FILE!r}: mlx-lm with "
                             "--trust-remote-code would import that file; do not trust this folder")
    path = folder / MODEL_FILE
    if path.is_symlink() or not path.is_file():
        raise IntegrityError(f"{path} is missing or not a plain file")
    if path.read_bytes() != MODEL_FILE_TEXT.encode("utf-8"):
        raise IntegrityError(f"{path} differs from the model file mlx-dq writes: it was altered; do not trust this "
                             "folder with --trust-remote-code (mlx_dq.load and mlx_dq generate never run it)")
    return f"{folder}: {MODEL_FILE} is byte-identical to mlx-dq's shim and config.json names exactly it"
