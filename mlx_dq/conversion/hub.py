"""The Hugging Face hub side of an output folder: the source files it carries, and uploading it.

Tokenizer files, the chat template and the generation config are copied from
the source byte for byte, so the output chats exactly like its source.
Uploads go through huggingface-hub's API and only for a complete folder;
being offline (``HF_HUB_OFFLINE=1``, or no route to the hub) is found out
before anything is sent or, in ``convert``, before any work starts.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlx_dq.conversion.card import update_card
from mlx_dq.conversion.writer import read_manifest
from mlx_dq.errors import MlxDqError
from mlx_dq.names import CARRIED_FILES, MANIFEST_NAME, MANIFEST_SCHEMA

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken", "tiktoken.model")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_EXCLUDED_SUFFIXES = (".pyc", ".tmp", ".partial")
CONNECT_TIMEOUT_S = 5.0


class HubError(MlxDqError):
    """Uploading cannot work now (offline, not logged in, bad repo id, incomplete folder)."""


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def carry_source_files(source: Any, dst: str | Path) -> list[str]:
    """Copy the source's tokenizer files, chat template and generation config into ``dst`` unchanged.

    For a GGUF source the files are the tokenizer rebuilt from its metadata. When
    the source folder holds no tokenizer file, the loaded tokenizer is saved instead.
    Returns the names copied.
    """
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    src_dir = Path(source._tokenizer_dir())
    names = sorted(p.name for p in src_dir.iterdir() if p.is_file() and _matches(p.name, CARRIED_FILES))
    if not any(_matches(n, _TOKENIZER_FILES) for n in names):
        source.save_tokenizer(dst)
        return sorted(p.name for p in dst.iterdir() if _matches(p.name, CARRIED_FILES))
    for name in names:
        shutil.copyfile(src_dir / name, dst / name)
    return names


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` when it has the hub's ``USER/NAME`` form, else HubError."""
    if not isinstance(repo_id, str) or not _REPO_RE.match(repo_id) or ".." in repo_id:
        raise HubError(f"upload repo must be USER/NAME (letters, digits, '.', '_', '-'), got {repo_id!r}")
    return repo_id


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def endpoint() -> str:
    """The hub's address (``HF_ENDPOINT`` when set, read now, not at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def check_online(timeout: float = CONNECT_TIMEOUT_S) -> None:
    """HubError at once when the hub cannot be reached: HF_HUB_OFFLINE set, or no connection to its address."""
    if _offline_env():
        raise HubError("cannot upload: HF_HUB_OFFLINE is set (unset it to upload)")
    url = urlparse(endpoint())
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise HubError(f"cannot upload: no connection to the hub at {url.scheme}://{host}:{port} ({e})") from None


def check_upload_ready(repo_id: str) -> None:
    """Everything that can be checked before a long conversion: repo id form, network, a token."""
    check_repo_id(repo_id)
    check_online()
    from huggingface_hub import get_token

    if not get_token():
        raise HubError("cannot upload: no Hugging Face token (run `hf auth login` or set HF_TOKEN)")


def upload_files(folder: str | Path) -> list[str]:
    """The files of output ``folder`` an upload sends, sorted (relative paths; hidden and temporary files left out).

    HubError when the folder is not a complete mlx-dq output (no manifest, config or weights) or fails
    :func:`mlx_dq.conversion.report.verify_folder` (a model file that is not mlx-dq's shim, a changed weight file).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HubError(f"{folder} is not a folder")
    manifest = folder / MANIFEST_NAME
    try:
        ok = json.loads(manifest.read_text()).get("schema") == MANIFEST_SCHEMA
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok or not (folder / "config.json").is_file():
        raise HubError(f"{folder} is not a complete mlx-dq output folder (no valid {MANIFEST_NAME} or config.json)")
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if not p.is_file() or any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        if p.name.endswith(_EXCLUDED_SUFFIXES):
            continue
        files.append(rel.as_posix())
    if not any(f.endswith(".safetensors") for f in files):
        raise HubError(f"{folder} holds no weights (*.safetensors): not a complete output folder")
    from mlx_dq.conversion.report import verify_folder

    try:
        verify_folder(folder)  # what `mlx_dq verify` checks: the model file shim, sizes, headers, checksums
    except MlxDqError as e:
        raise HubError(f"not uploading {folder}: it fails `mlx_dq verify`: {e}") from None
    return files


def upload(folder: str | Path, repo_id: str, *, private: bool = False, commit_message: str | None = None) -> str:
    """Upload the complete output ``folder`` to the hub model repo ``repo_id`` (created if needed); return its URL.

    Checks first (folder complete, repo id, network, token), so that a failure
    leaves nothing half-sent; the local folder is never changed.
    """
    files = upload_files(folder)
    check_upload_ready(repo_id)
    from huggingface_hub import create_repo, upload_folder

    try:
        url = create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", allow_patterns=files,
                      commit_message=commit_message or "Upload mlx-dq quantized model")
    except Exception as e:  # network, permission or server errors all end here
        detail = (str(e).strip().splitlines() or [""])[0]
        raise HubError(f"upload to {repo_id} failed ({type(e).__name__}: {detail}); {folder} is unchanged") from e
    return str(url)


def upload_output(mlx_path: str | Path, upload_repo: str, *, private: bool = False) -> str:
    """Upload a complete output folder to the hub repo ``upload_repo``; return the repo URL.

    Everything is checked first (complete folder, repo id, network, token); the
    card's load instructions are then pointed at the repo and the folder is sent.
    """
    upload_files(mlx_path)
    check_upload_ready(upload_repo)
    update_card(mlx_path, read_manifest(mlx_path), ref=upload_repo)
    return upload(mlx_path, upload_repo, private=private)
