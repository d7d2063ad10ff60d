"""Cost of measure and convert at real model shapes, extrapolated to the full depth.

Builds random-weight models on disk (bfloat16 safetensors, a few decoder
layers, the real vocabulary) at the shapes of Llama-3-8B, Llama-3-70B and a
0.5B-class model with a 151,936-token vocabulary, then runs ``measure`` and
``convert`` on each in a child process (so each peak RSS is its own) and
prints, per decoder layer and for the head stage: seconds, multiply-adds
(counted from the shapes: the forward, plus out x in^2 per option per tensor
for GPTQ and the exact error), achieved FLOP/s against a plain float32
``mx.matmul`` on the same device, the numpy share of measure time and the peak
RSS (sampled every 20 ms); then totals extrapolated to the full depth.

Numpy share: own time (cProfile) of numpy functions and of the functions whose
own time is numpy's ndarray operators (GPTQ's column loop, its fp16 helpers, the
Gram permutations; operators do not show up as calls) over the own time of every
thread of the measure (the main thread and each worker thread, each profiled;
time spent waiting, for a lock or by an idle worker for its next task, left
out). MLX's calls do not show up as calls either: their time is their callers'.
Functions that mix both (``add_gram``'s in-place sums) count as MLX's.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/scale.py --shapes 0.5b --method rtn --grid fast --rows 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # hidden, intermediate, heads, kv heads, vocabulary, full depth, tied
    "tiny": dict(hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=8192, depth=4, tie=False,
                 model_type="llama"),  # a smoke test of this script
    "0.5b": dict(hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, depth=24, tie=False,
                 model_type="qwen2"),
    "8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, depth=32, tie=False,
               model_type="llama"),
    "70b": dict(hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256, depth=80, tie=False,
                model_type="llama"),
}

BUILD = r"""
import json, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, sys.argv[3])
from fixtures_models import save_tokenizer, tiny_config
folder, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
cfg = tiny_config(spec["model_type"], spec["layers"], hidden=spec["hidden"], intermediate=spec["intermediate"],
                  heads=spec["heads"], kv_heads=spec["kv_heads"], tie=spec["tie"])
cfg["vocab_size"] = spec["vocab"]
folder.mkdir(parents=True, exist_ok=True)
(folder / "config.json").write_text(json.dumps(cfg, indent=2))
h, f, d = spec["hidden"], spec["intermediate"], spec["hidden"] // spec["heads"]
shapes = {"model.embed_tokens.weight": (spec["vocab"], h), "model.norm.weight": (h,)}
if not spec["tie"]:
    shapes["lm_head.weight"] = (spec["vocab"], h)
for i in range(spec["layers"]):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (spec["heads"] * d, h),
                   p + "self_attn.k_proj.weight": (spec["kv_heads"] * d, h),
                   p + "self_attn.v_proj.weight": (spec["kv_heads"] * d, h),
                   p + "self_attn.o_proj.weight": (h, spec["heads"] * d),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f)})
    if spec["model_type"] == "qwen2":
        shapes.update({p + "self_attn.q_proj.bias": (spec["heads"] * d,),
                       p + "self_attn.k_proj.bias": (spec["kv_heads"] * d,),
                       p + "self_attn.v_proj.bias": (spec["kv_heads"] * d,)})
mx.random.seed(0)
weights = {}
for k, s in shapes.items():
    if k.endswith("norm.weight"):
        weights[k] = (1.0 + 0.1 * mx.random.normal(s)).astype(mx.bfloat16)
    elif k.endswith(".bias"):
        weights[k] = (0.05 * mx.random.normal(s)).astype(mx.bfloat16)
    else:
        weights[k] = (mx.random.normal(s) / (s[-1] ** 0.5)).astype(mx.bfloat16)
    mx.eval(weights[k])
mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
save_tokenizer(folder)
print(folder)
"""

CHILD = r"""
import cProfile, json, os, pstats, resource, sys, threading, time
import mlx.core as mx
folder, args = sys.argv[1], json.loads(sys.argv[2])
samples, stop = [], threading.Event()
def sample():
    while not stop.is_set():
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    samples.append((time.perf_counter(), int(line.split()[1]) / 1024))
        stop.wait(0.02)
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
out = {}
if args["stage"] == "measure":
    import mlx_dq.measure.stream as mm
    from mlx_dq.measure.stream import measure
    orig_save = mm.save_measurement
    marks = []
    def save(m, p):
        orig_save(m, p)
        marks.append(time.perf_counter() - t0)
    mm.save_measurement = save
    workers = []  # a profile per worker thread (the tensors of a layer, a head's blocks), started by each thread
    def start(frame, event, arg):
        p = cProfile.Profile()
        workers.append(p)
        p.enable()  # replaces this hook in the thread that called it
    threading.setprofile(start)
    prof = cProfile.Profile()
    prof.enable()
    m = measure(folder, grid=args["grid"], rows=args["rows"], seq_len=args["seq_len"], method=args["method"],
                out_path=args["out"], progress=False, sample_rows=args["sample_rows"],
                **({"head_chunk": args["head_chunk"]} if args["head_chunk"] else {}))
    prof.disable()
    threading.setprofile(None)
    stats = [pstats.Stats(prof).stats]
    for p in workers:  # their threads have ended; snapshot without touching this thread's profiler
        p.snapshot_stats()
        stats.append(p.stats)
    # own time of every thread, less the time spent waiting (for a lock, or an idle worker for its next task);
    # numpy's part of it: numpy's functions and methods, and the functions whose own time is numpy's operators
    waits = ("acquire", "'get' of '_queue.SimpleQueue'")
    numpy_own = {("gptq_core.py", n) for n in ("_run_block", "_pending_columns", "write_columns")} \
        | {("storage.py", n) for n in ("codes", "dequantize", "round_to")} | {("hessian.py", "_reversed_damped")} \
        | {("linalg.py", n) for n in ("permute_in_place", "reverse_in_place", "_small_cholesky",
                                      "_small_lower_inverse")}
    own = [(k, v[2]) for st in stats for k, v in st.items() if not (k[0] == "~" and any(w in k[2] for w in waits))]
    total = sum(t for _, t in own)
    parts = {}
    for k, t in own:
        if "numpy" in k[0] or "numpy" in k[2] or (os.path.basename(k[0]), k[2]) in numpy_own:
            parts[k[2]] = parts.get(k[2], 0.0) + t
    out["numpy_share"] = sum(parts.values()) / total if total else 0.0
    out["numpy_top"] = sorted(((round(t, 2), n) for n, t in parts.items()), reverse=True)[:6]
    out["own_seconds"] = total
    out["profiled_threads"] = len(stats)
    out["timing"] = m.extra["timing"]
    out["marks"] = marks
    out["options"] = {k: len(t.options) for k, t in m.tensors.items()}
else:
    from mlx_dq.conversion.pipeline import convert
    convert(folder, args["out"], bpw=args["bpw"], measurement=args["measurement"], rows=args["rows"],
            seq_len=args["seq_len"], method=args["method"], progress=False, force=True)
out["seconds"] = time.perf_counter() - t0
stop.set()
out["t0"] = t0
out["rss"] = [(round(t - t0, 3), round(r, 1)) for t, r in samples]
# this process's own high-water mark: Linux's ru_maxrss also counts the parent's resident size at fork (a parent that
# timed GPTQ on a 8192 x 8192 tensor made every later child report its 2.9 GB)
hwm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")] \
    if os.path.exists("/proc/self/status") else []
out["peak_rss_mb"] = hwm[0] / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT " + json.dumps(out))
"""


def layer_tensors(s: dict) -> list[tuple[int, int]]:
    """(out, in) of each quantizable tensor of one decoder layer."""
    h, f, d = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    return [(s["heads"] * d, h), (s["kv_heads"] * d, h), (s["kv_heads"] * d, h), (h, s["heads"] * d),
            (f, h), (f, h), (h, f)]


def layer_macs(s: dict, tokens: int, imp_tokens: int, options: int, method: str, sample_rows: int) -> float:
    """Multiply-adds of measuring one decoder layer, as the measurer does them (mlx_dq.conversion.estimate's counts).

    Forward with the Gram of the 3 distinct inputs, the importance reruns, then per tensor the
    reference option on every output row and each other option on ``sample_rows`` rows (0: all):
    GPTQ's triangular column updates (``out x in^2 / 2``; the error comes from its own errors), rounding's
    error against the Gram (``out x in^2``); once per tensor the meter's reference sum over the rows measured
    (every row's output energy, for the sample, comes from the forward's outputs: no multiply-adds).
    """
    ts = layer_tensors(s)
    params = sum(o * i for o, i in ts)
    fwd = tokens * params + sum(tokens * i * i for _, i in ts[::3]) + 3 * imp_tokens * params
    per = 0.5 if method == "gptq" else 1
    rows = [(min(o, sample_rows) if sample_rows else o, o, i) for o, i in ts]
    opts = sum(((options - 1) * r + o) * i * i * per + r * i * i for r, o, i in rows)
    return fwd + opts


def head_macs(s: dict, tokens: int, imp_tokens: int, options: int, method: str, sample_rows: int) -> float:
    """Multiply-adds of the head stage: logits of the importance rows (the base perplexity), two anchor options quantized on every
    vocabulary row with their KL taken block by block (original and quantized rows, plus one LSE pass) and
    the meter's reference sum, the other options on a row sample (mlx_dq.measure.head.head_anchors) with their
    damage predicted from the error against the Gram, and every row's energy for the sample; all of them
    exactly without sampling (counts as in :func:`layer_macs`); one pass through the head for each copy carried to
    the logits (the sampled layers', the lookup table's)."""
    from mlx_dq.measure.head import HEAD_SAMPLE_FACTOR
    from mlx_dq.measure.stream import KL_SAMPLE_LAYERS

    v, h = s["vocab"], s["hidden"]
    per = 0.5 if method == "gptq" else 1
    sampled = min(v, HEAD_SAMPLE_FACTOR * sample_rows + min(tokens, v))
    full = 2 if sample_rows and options > 2 and sampled < v else options
    kl = (2 * full + 1 + min(KL_SAMPLE_LAYERS, s["layers"]) + 1) * imp_tokens * v * h
    predicted = (options - full) * sampled * h * h * (per + 1) + v * h * h if full < options else 0  # + energies
    return imp_tokens * v * h + full * v * h * h * per + v * h * h + predicted + kl


def hot_loop_problem(h: int) -> tuple:
    """The hot loop's tensor: a random ``h x h`` weight, the Gram of ``4h`` random inputs, the 4-bit g64 option and
    a factor cache with the Hessian already factored (also used by ``scale_search.py``)."""
    import mlx.core as mx

    from mlx_dq.quant.dispatch import quantize_tensor
    from mlx_dq.quant.options import QuantOption
    from mlx_dq.quant.spec import QuantizerSpec

    mx.random.seed(1)
    w = mx.random.normal((h, h)) / h ** 0.5
    x = mx.random.normal((4 * h, h))
    gram = x.T @ x
    mx.eval(w, gram)
    cache: dict = {}
    opt = QuantOption.parse("1.0:4b_64g")
    quantize_tensor(w, opt, gram, QuantizerSpec(clip=False), factor_cache=cache)  # factor the Hessian once
    return w, gram, opt, cache


def hot_loop(s: dict, flops: float, repeat: int = 1) -> dict:
    """GPTQ alone on one ``hidden x hidden`` tensor of this shape (Hessian factor cached; the column loop,
    the lazy updates and the per-group scale search): seconds (the median of ``repeat`` runs) and FLOP/s, counting
    ``out x in^2 / 2`` multiply-adds (the triangular updates) against a plain matmul."""
    import mlx.core as mx

    from mlx_dq.quant.dispatch import quantize_tensor
    from mlx_dq.quant.spec import QuantizerSpec

    h = s["hidden"]
    w, gram, opt, cache = hot_loop_problem(h)
    runs = []
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        mx.eval(*quantize_tensor(w, opt, gram, QuantizerSpec(clip=False), factor_cache=cache).parts[0])
        runs.append(time.perf_counter() - t)
    sec = sorted(runs)[len(runs) // 2]
    fl = 2 * (h * h * h / 2) / sec
    return {"tensor": [h, h], "seconds": sec, "runs": runs, "flops": fl, "of_matmul": fl / flops}


def run_child(code: str, folder: Path, args: dict, src: Path = ROOT) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(args)], capture_output=True, text=True,
                         env=env)
    if res.returncode != 0:
        raise SystemExit(f"child failed:\n{res.stderr[-3000:]}")
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def peak_between(rss: list, a: float, b: float) -> float:
    vals = [r for t, r in rss if a <= t <= b]
    return max(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.5b", help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--layers", type=int, default=1, help="decoder layers built (1-2)")
    ap.add_argument("--rows", type=int, default=16, help="calibration rows (measure's default: 16)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--method", default="gptq", choices=["gptq", "rtn"])
    ap.add_argument("--grid", default=None, help="default, fast or a JSON file")
    ap.add_argument("--head-chunk", type=int, default=0, help="positions per head call (0: the default)")
    ap.add_argument("--no-convert", action="store_true", help="measure only")
    ap.add_argument("--bpw", type=float, default=3.5)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--code", default=str(ROOT), help="folder holding the mlx_dq package to run (before/after)")
    ap.add_argument("--keep", default=None, help="build the models in this folder and keep them")
    ap.add_argument("--sample-rows", type=int, default=None, help="measure's --sample-rows (default: its default)")
    ap.add_argument("--no-hot-loop", action="store_true", help="skip timing GPTQ alone on one tensor")
    ap.add_argument("--hot-loop-only", action="store_true", help="time GPTQ alone on one tensor per shape only")
    ap.add_argument("--repeat", type=int, default=1, help="hot loop runs (the median is reported)")
    args = ap.parse_args()
    from mlx_dq.conversion.estimate import matmul_flops

    flops = matmul_flops(2048)
    print(f"plain float32 mx.matmul on {__import__('mlx.core').core.default_device()}: {flops / 1e9:.1f} GFLOP/s")
    if args.sample_rows is None:
        from mlx_dq.settings import MeasureSettings

        args.sample_rows = MeasureSettings.sample_rows
    results = {"matmul_flops": flops, "args": vars(args), "shapes": {}}
    if args.hot_loop_only:
        for name in args.shapes.split(","):
            results["shapes"][name] = {"hot_loop": report_hot_loop(SHAPES[name], flops, args.repeat)}
    else:
        run_shapes(args, flops, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def report_hot_loop(s: dict, flops: float, repeat: int) -> dict:
    """:func:`hot_loop`, printed."""
    hl = hot_loop(s, flops, repeat)
    runs = ", ".join(f"{r:.2f}" for r in hl["runs"])
    print(f"GPTQ alone on a {hl['tensor'][0]} x {hl['tensor'][1]} tensor (factor cached): "
          f"{hl['seconds']:.2f} s, {hl['flops'] / 1e9:.1f} GFLOP/s = {hl['of_matmul']:.0%} of matmul"
          + (f" (median of {len(hl['runs'])}: {runs} s)" if len(hl["runs"]) > 1 else ""))
    return hl


def run_shapes(args: argparse.Namespace, flops: float, results: dict) -> None:
    """Build, measure and convert each shape of ``args.shapes``; figures printed and added to ``results``."""
    with tempfile.TemporaryDirectory() as td:
        base = Path(args.keep or td)
        for name in args.shapes.split(","):
            s = dict(SHAPES[name], layers=args.layers)
            folder = base / f"scale-{name}-{args.layers}l"
            if not (folder / "model.safetensors").exists():
                subprocess.run([sys.executable, "-c", BUILD, str(folder), json.dumps(s), str(ROOT / "tests")],
                               check=True, capture_output=True)
            mpath = base / f"{name}.measurement.json"
            mpath.unlink(missing_ok=True)
            meas = run_child(CHILD, folder, {"stage": "measure", "grid": args.grid, "rows": args.rows,
                                             "seq_len": args.seq_len, "method": args.method, "out": str(mpath),
                                             "head_chunk": args.head_chunk, "sample_rows": args.sample_rows},
                             Path(args.code))
            tokens = args.rows * args.seq_len
            imp_tokens = min(4, args.rows) * args.seq_len
            opts = max(meas["options"].values())
            sample_rows = args.sample_rows
            lay = meas["timing"]["layers_s"]
            rows_out = []
            print(f"\n== {name}: hidden {s['hidden']}, intermediate {s['intermediate']}, vocab {s['vocab']}, "
                  f"{args.layers} layer(s) built, full depth {s['depth']}; {args.method}, grid {args.grid or 'default'}, "
                  f"{args.rows} x {args.seq_len} tokens")
            print(f"{'stage':>8} {'seconds':>8} {'GMAC':>9} {'GFLOP/s':>8} {'of matmul':>9} {'peak RSS MB':>11}")
            marks = meas["marks"]  # end of each layer's save, then the final save
            for i, sec in enumerate(lay):
                macs = layer_macs(s, tokens, imp_tokens, opts, args.method, sample_rows)
                rss = peak_between(meas["rss"], marks[i] - sec, marks[i])
                rows_out.append({"stage": f"layer {i}", "seconds": sec, "macs": macs, "peak_rss_mb": rss})
            head_s = marks[-1] - marks[len(lay) - 1]
            setup = meas["seconds"] - sum(lay) - head_s
            # the head's matmul work (an untied embedding is a lookup table: its options are elementwise work on
            # the looked-up rows, no multiply-adds counted)
            head = "lm_head" if "lm_head" in meas["options"] else "model.embed_tokens"
            hm = head_macs(s, tokens, imp_tokens, meas["options"][head], args.method, sample_rows)
            rows_out.append({"stage": "head", "seconds": head_s, "macs": hm,
                             "peak_rss_mb": peak_between(meas["rss"], marks[len(lay) - 1], marks[-1] + 0.1)})
            for r in rows_out:
                fl = 2 * r["macs"] / r["seconds"] if r["seconds"] > 0 else 0.0
                r["flops"] = fl
                print(f"{r['stage']:>8} {r['seconds']:>8.1f} {r['macs'] / 1e9:>9.1f} {fl / 1e9:>8.2f} "
                      f"{fl / flops:>8.1%} {r['peak_rss_mb']:>11.0f}")
            print(f"{'setup':>8} {setup:>8.1f}   (loading, calibration text, embedding)")
            per_layer = sum(lay) / len(lay)
            total_measure = setup + per_layer * s["depth"] + head_s
            print(f"measure: {meas['seconds']:.1f} s here, peak RSS {meas['peak_rss_mb']:.0f} MB, "
                  f"numpy share {meas['numpy_share']:.1%} of {meas.get('own_seconds', 0):.0f} s "
                  f"({meas.get('profiled_threads', 1)} threads profiled; largest: "
                  + ", ".join(f"{n} {t:.1f} s" for t, n in meas.get("numpy_top", [])) + "); "
                  f"extrapolated to {s['depth']} layers: "
                  f"{total_measure / 60:.1f} min")
            res = {"shape": s, "measure": {k: v for k, v in meas.items() if k != "rss"}, "stages": rows_out,
                   "extrapolated_measure_s": total_measure}
            if not args.no_convert:
                conv = run_child(CHILD, folder, {"stage": "convert", "out": str(base / f"{name}-q"), "bpw": args.bpw,
                                                 "measurement": str(mpath), "rows": args.rows,
                                                 "seq_len": args.seq_len, "method": args.method},
                                 Path(args.code))
                per = conv["seconds"] / (args.layers + 1)
                print(f"convert at {args.bpw} bpw: {conv['seconds']:.1f} s here ({per:.1f} s per stage of "
                      f"{args.layers} layer(s) + head), peak RSS {conv['peak_rss_mb']:.0f} MB; extrapolated to "
                      f"{s['depth']} layers: {per * (s['depth'] + 1) / 60:.1f} min")
                res["convert"] = {k: v for k, v in conv.items() if k != "rss"}
            if not args.no_hot_loop:
                res["hot_loop"] = report_hot_loop(s, flops, args.repeat)
            results["shapes"][name] = res


if __name__ == "__main__":
    main()
