"""Where a plan loses out of sample: the damage the measurement predicted against the KL a part really causes.

For each part of an mlx-dq output folder's plan (each role in each third of the layers, each layer, the
tensors outside the layers; ``--by tensor``, every tensor; ``--by scope``, the whole decoder and the rest),
puts that part's quantized weights alone into the float source and measures the KL divergence against the
source on each evaluation text; beside it, the damage the measurement predicted for the planned options (the
plan's objective is their sum, the embedding's and head's at the plan's ``head_damage_weight``). Extra
measurements of the same model (e.g. one calibrated on the evaluation text's domain) add predicted columns, so
a reader sees whether the measurement mispredicts a part on another text or only ranks it differently. Writes a
CSV with one row per part and prints the table and the Spearman rank correlation of predicted and real damage.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/plan_gap.py OUT_FOLDER --text calib --text shakespeare \\
            [--measurement shakes=meas_shakes.json] [--rows 8 --seq-len 256] -o plan_gap.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


def option_damage(measurement: dict) -> dict[str, dict[str, float]]:
    """Tensor key -> option desc -> the damage the measurement predicts (what the optimizer sums)."""
    out: dict[str, dict[str, float]] = {}
    for r in measurement["measurement"]:
        out[r["key"]] = {o["desc"]: float(o.get("damage", r["importance"] * o["err"] ** 2)) for o in r["options"]}
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists (ties ranked by position, enough for continuous damages)."""
    ra = np.argsort(np.argsort(np.asarray(a)))
    rb = np.argsort(np.argsort(np.asarray(b)))
    return float(np.corrcoef(ra, rb)[0, 1])


def _texts(spec: str) -> tuple[list[str], str]:
    from mlx_dq.data import calib

    if spec == "calib":
        return calib.default_calibration_texts(), "the bundled calibration text"
    return calib.resolve_eval_texts(spec)


def _swap_weights(q: nn.Module, key: str) -> list[tuple[str, mx.array]]:
    """The float32 parameters of module ``key`` of the dequantized model (weight, and bias where quantized)."""
    mod = dict(q.named_modules())[key]
    return [(f"{key}.{name}", v) for name, v in tree_flatten(mod.parameters())]


def _dequantized(folder: str) -> nn.Module:
    from mlx_dq.evaluation import metrics as evaluate
    from mlx_dq.layers.rowsplit import RowSplitEmbedding

    q = evaluate.dequantize_model(evaluate.load_for_eval(folder)[0])
    for path, m in list(q.named_modules()):  # frequent-token rows: one float table again
        if isinstance(m, RowSplitEmbedding):
            whole = nn.Embedding(*m.table().shape)
            whole.weight = m.table()
            q.update_modules(tree_unflatten([(path, whole)]))
    return q


def groups(rows: list[dict], by: str) -> list[tuple[str, str, list[dict]]]:
    """(kind, label, member tensors): every tensor alone; the decoder against the tensors outside the layers
    (embedding, head); or each role in each third of the layers and each layer."""
    if by == "tensor":
        return [("tensor", r["key"], [r]) for r in rows]
    if by == "scope":
        return [("scope", label, rs) for label, rs in (("decoder", [r for r in rows if r["layer"] is not None]),
                                                       ("outside the layers", [r for r in rows if r["layer"] is None]))
                if rs]
    out: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        if r["layer"] is None:
            out[("outside", r["key"])].append(r)
            continue
        out[("role x third", f"{r['key'].rsplit('.', 1)[-1]} layers {r['third']}")].append(r)
        out[("layer", f"layer {r['layer']:02d}")].append(r)
    return [(k, label, rs) for (k, label), rs in out.items()]


def _summaries(table: list[dict], texts: list[str], labels: list[str], whole: dict[str, float]) -> None:
    for t in texts:
        print(f"\n== text {t}: whole-model KL {whole[t]:.4f}, predicted (sum of damages) "
              + ", ".join(f"{lab} {sum(g['pred_' + lab] for g in table if g['kind'] != 'layer'):.4f}" for lab in labels))
        for kind in dict.fromkeys(g["kind"] for g in table):
            part = [g for g in table if g["kind"] == kind]
            if len(part) > 2:
                print(f"   {kind}: Spearman(predicted[{labels[0]}], real[{t}]) over {len(part)} groups "
                      f"{spearman([g['pred_' + labels[0]] for g in part], [g['kl_' + t] for g in part]):.3f}; "
                      f"sum of real {sum(g['kl_' + t] for g in part):.4f}")
        print(f"   {'group':26s} {'n':>3s} {'bpw':>5s} " + " ".join(f"{'pred ' + lab:>13s}" for lab in labels)
              + f" {'real':>8s} {'real/pred':>9s}")
        for g in sorted(table, key=lambda g: (g["kind"], g["label"])):
            print(f"   {g['label']:26s} {g['n']:3d} {g['bpw']:5.2f} " + " ".join(f"{g['pred_' + lab]:13.4f}"
                  for lab in labels) + f" {g['kl_' + t]:8.4f} {g['kl_' + t] / max(g['pred_' + labels[0]], 1e-12):9.2f}")


def main() -> None:
    from mlx_dq.data import calib
    from mlx_dq.evaluation import metrics as evaluate
    from mlx_dq.model.sources import load_model
    from mlx_dq.names import layer_index

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="an mlx-dq output folder (plan.json, measurement.json, mlx_dq.json)")
    ap.add_argument("--text", action="append", required=True, help="evaluation text: calib, a name or a file")
    ap.add_argument("--measurement", action="append", default=[], help="LABEL=PATH: another measurement's prediction")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--by", choices=["group", "tensor", "scope"], default="group",
                    help="swap each role in each third of the layers and each layer (default), every tensor, or the "
                         "whole decoder and the tensors outside it")
    ap.add_argument("-o", "--output", type=Path, required=True, help="CSV to write (one row per tensor)")
    args = ap.parse_args()

    folder = Path(args.folder)
    plan = json.loads((folder / "plan.json").read_text())
    meas = json.loads((folder / "measurement.json").read_text())
    preds = {"calib": option_damage(meas)}
    for spec in args.measurement:
        label, _, path = spec.partition("=")
        preds[label] = option_damage(json.loads(Path(path).read_text()))
    labels = list(preds)
    q = _dequantized(str(folder))
    src, tokenizer, _ = load_model(evaluate.manifest_base(str(folder)), dtype=mx.float32)
    source_weights = dict(tree_flatten(src.parameters()))
    n_layers = 1 + max((layer_index(k) or 0) for k in source_weights)
    rows = [{"key": t["key"], "option": t["option"], "bits": t["bits"], "numel": t["numel"],
             "role": "", "layer": layer_index(t["key"]), "third": "outside" if layer_index(t["key"]) is None
             else f"{min(2, 3 * layer_index(t['key']) // n_layers) + 1}/3"} for t in plan["tensors"]]
    roles = {r["key"]: r["role"] for r in meas["measurement"]}
    for r in rows:
        r["role"] = roles.get(r["key"], "?")
        for lab in labels:
            r["pred_" + lab] = preds[lab].get(r["key"], {}).get(r["option"], float("nan"))
    table = [{"kind": kind, "label": label, "n": len(rs),
              "bpw": sum(r["bits"] for r in rs) / sum(r["numel"] for r in rs),
              **{"pred_" + lab: sum(r["pred_" + lab] for r in rs) for lab in labels},
              "keys": [r["key"] for r in rs]} for kind, label, rs in groups(rows, args.by)]
    whole = {}
    for spec in args.text:
        texts, name = _texts(spec)
        ev = calib.sample_rows(tokenizer, texts, args.rows, args.seq_len, args.seed)
        ref = evaluate.reference(src, ev)
        src.load_weights(list(dict(tree_flatten(q.parameters())).items()), strict=False)
        whole[spec] = evaluate.kl_divergence(ref, src, ev)["kl"]
        src.load_weights(list(source_weights.items()), strict=False)
        t0 = time.perf_counter()
        for i, g in enumerate(table):
            weights = [w for k in g["keys"] for w in _swap_weights(q, k)]
            src.load_weights(weights, strict=False)
            g["kl_" + spec] = evaluate.kl_divergence(ref, src, ev)["kl"]
            src.load_weights([(k, source_weights[k]) for k, _ in weights], strict=False)
            if i % 10 == 0:
                print(f"{spec}: {i + 1}/{len(table)} groups, {time.perf_counter() - t0:.0f} s", flush=True)
        print(f"text {spec} ({name}): done in {time.perf_counter() - t0:.0f} s", flush=True)
    with args.output.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in table[0] if k != "keys"], extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    _summaries(table, args.text, labels, whole)


if __name__ == "__main__":
    main()
