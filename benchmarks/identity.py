"""Fingerprints of conversions, to show that a change of code left behaviour byte-identical.

Converts tiny random llama and qwen3_moe models at 3.5 bpw with each quantizer
(gptq, rtn, rtn + clip search), optionally an existing output folder too, and
prints one JSON object: every output file's sha256 (the manifest and model card
without their timing and path fields) and the measurement with its timing
fields removed. Run it on two checkouts and compare the two files:

    python benchmarks/identity.py -o before.json            # on the old code
    python benchmarks/identity.py -o after.json             # on the new code
    python benchmarks/identity.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Fields that differ between two runs of the same code: wall times, the command, paths, package versions.
VOLATILE = frozenset({"forward_s", "importance_s", "layers_s", "options_s", "total_s", "wall_s", "quantization_seconds",
                      "command", "path", "spec", "version", "versions", "created", "date"})
METHODS = {"gptq": {"method": "gptq"}, "rtn": {"method": "rtn", "clip": False}, "rtn_clip": {"method": "rtn", "clip": True}}


def _volatile(key: str) -> bool:
    return key in VOLATILE


def _strip(doc: Any, parent: str = "") -> Any:
    """``doc`` without the fields that change from run to run (a measurement's hash covers its timings)."""
    if isinstance(doc, dict):
        return {k: _strip(v, k) for k, v in doc.items()
                if not _volatile(k) and not (k == "sha256" and parent == "measurement")}
    if isinstance(doc, list):
        return [_strip(v, parent) for v in doc]
    return doc


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(folder: Path) -> dict[str, str]:
    """sha256 of every file of an output folder; JSON files hashed without their volatile fields."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.name == "README.md" or "__pycache__" in p.parts:
            continue
        data = p.read_bytes()
        if p.suffix == ".json":
            data = json.dumps(_strip(json.loads(data)), sort_keys=True).encode()
        out[str(p.relative_to(folder))] = _sha(data)
    return out


def run_tiny(tmp: Path) -> dict[str, dict[str, str]]:
    """Convert tiny llama and qwen3_moe at 3.5 bpw with each method; fingerprints by case."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_models import make_tiny_model_folder

    from mlx_dq.api import convert

    results = {}
    for model_type in ("llama", "qwen3_moe"):
        src = make_tiny_model_folder(tmp, model_type, 2)
        for name, how in METHODS.items():
            out = tmp / f"{model_type}-{name}"
            convert(str(src), str(out), bpw=3.5, rows=4, seq_len=32, progress=False,
                    measure_kwargs={"rows": 4, "seq_len": 32}, **how)
            results[f"{model_type}/{name}"] = fingerprint(out)
    return results


def compare(a: Path, b: Path) -> int:
    """Print the cases and files whose fingerprints differ; 0 when none do."""
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    bad = 0
    for case in sorted(set(da) | set(db)):
        fa, fb = da.get(case, {}), db.get(case, {})
        for f in sorted(set(fa) | set(fb)):
            if fa.get(f) != fb.get(f):
                bad += 1
                print(f"differs: {case} {f}")
    print(f"{len(set(da) | set(db))} cases, {bad} differing file(s)")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, help="write the fingerprints here (JSON)")
    ap.add_argument("--folder", type=Path, action="append", default=[], help="also fingerprint this output folder")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny-model conversions")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    # one fixed folder, so that paths recorded in the outputs are the same in every run
    tmp = Path(tempfile.gettempdir()) / "mlx_dq_identity"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        results = {} if args.no_tiny else run_tiny(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for folder in args.folder:
        results[f"folder/{folder.name}"] = fingerprint(folder)
    text = json.dumps(results, indent=1, sort_keys=True)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
