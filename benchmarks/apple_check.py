"""One command for the first run on a Mac: Metal correctness, mixed vs uniform speed, generation, cost at scale.

    python benchmarks/apple_check.py                 # on Apple silicon: every part, ~30-60 min
    python benchmarks/apple_check.py --quick --skip-generate --out /tmp/x.md   # a smoke run anywhere

Parts (each prints its figures and goes into the results file, ``--out``,
default benchmarks/results/apple_silicon.md, in the section of this backend; the
other backends' sections of that file are kept):

1. correctness: on Metal, the Metal-only tests (``pytest -m metal`` on
   tests/test_kernels.py and tests/test_mixed.py); on every backend, each forward
   path this backend has against a float64 numpy dequantize-then-matmul.
2. matmul: decode (1 row) and prefill (512 rows) of a mixed tensor
   (``MIXED``) against uniform 4-bit (``UNIFORM``) at the same bits per weight, at
   SmolLM2, Llama-3-8B and Llama-3-70B layer shapes, medians of interleaved calls;
   on Metal the fused kernel / per-segment quantized matmuls against
   ``mx.quantized_matmul``, on the CPU each CPU path (the non-Metal reference).
3. generate: the README's 3.5 bpw output and a uniform 4-bit conversion of the
   same model through ``mlx_dq.load`` + mlx-lm's generate: tok/s, MLX peak and
   the process's peak RSS above its RSS before loading; on the CPU with the float32
   cache on and off. Folders are built (``--work``) when not given.
4. scale: ``benchmarks/scale.py --shapes 8b`` on the default device: measure and
   convert time extrapolated to 32 layers, against its work at this device's
   float32 matmul FLOP/s.

Exit status: 1 when a correctness check fails; otherwise 0, also where parts
need Apple silicon (they are named as such in the output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_dq.layers import kernels  # noqa: E402 (after the sys.path line: runs from a checkout)
from mlx_dq.layers.mixed import MixedEmbedding, MixedLinear  # noqa: E402
from mlx_dq.quant.affine import quantize_weight  # noqa: E402
from mlx_dq.quant.options import QuantOption  # noqa: E402

MIXED = "0.5:5b_64g/0.5:3b_64g"  # 4.5 bits per weight, as UNIFORM (plus a uint16 permutation per input channel)
UNIFORM = "1.0:4b_64g"
SHAPES = {  # (out, in) of the MLP's up and down projections
    "tiny": [(256, 512), (512, 256)],
    "smollm2": [(1536, 576), (576, 1536)],
    "8b": [(14336, 4096), (4096, 14336)],
    "70b": [(28672, 8192), (8192, 28672)],
}
GOALS = {"decode": 0.95, "prefill": 0.90}  # mixed speed / uniform speed, on Metal
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SECTION = "<!-- apple_check:{} -->"


def rel_err(a: mx.array, b: np.ndarray) -> float:
    """Largest absolute difference relative to the largest reference value."""
    a64 = np.array(a.astype(mx.float32), dtype=np.float64)
    return float(np.abs(a64 - b).max() / max(np.abs(b).max(), 1e-12))


# ----------------------------------------------------------------------------- 1. correctness


def path_checks(seed: int = 0) -> list[tuple[str, float, float]]:
    """(check, relative error, tolerance) for each forward path this backend has, on small random layers."""
    w = mx.random.normal((72, 512), key=mx.random.key(seed)) * 0.05
    qt = quantize_weight(w, QuantOption.parse("0.25:6b_32g/0.5:4b_64g/0.25:3b_32g"), clip=False)
    layer, emb = MixedLinear.from_quantized(qt), MixedEmbedding.from_quantized(qt)
    w64 = np.array(layer.dequantize(), dtype=np.float64)
    where = kernels.backend()
    modes = [True, False] if where == "cpu" else [None]
    out = []
    for cache in modes:
        kernels.set_cpu_cache(cache)
        try:
            for rows in (1, 3, 9, 64):
                x = mx.random.normal((rows, 512), key=mx.random.key(rows))
                xd = x if where == "cpu" else x.astype(mx.float16)
                ref = np.array(xd.astype(mx.float32), dtype=np.float64) @ w64.T
                path = kernels.matmul_path(rows, True)
                tol = 1e-5 if where == "cpu" else 2e-3
                out.append((f"MixedLinear {path}, {rows} row(s)", rel_err(layer(xd), ref), tol))
                out.append((f"tied head {path}, {rows} row(s)", rel_err(emb.as_linear(xd), ref), tol))
            ids = mx.array([0, 5, 71])
            label = where if cache is None else f"cpu, cache {'on' if cache else 'off'}"
            out.append((f"embedding rows ({label})", rel_err(emb(ids), w64[[0, 5, 71]]), 1e-3))
        finally:
            kernels.set_cpu_cache(None)
    return out


def metal_tests() -> tuple[bool, str]:
    """Run the Metal-only tests; (passed, pytest's last line)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "metal",
           "tests/test_kernels.py", "tests/test_mixed.py"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    last = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
    return res.returncode == 0, last


def part_correctness(report: list[str]) -> bool:
    """Part 1; True when every check passed."""
    report.append("## 1. Correctness\n")
    ok = True
    if kernels.metal_active():
        passed, last = metal_tests()
        ok &= passed
        report.append(f"- Metal-only tests (`pytest -m metal`): {'pass' if passed else 'FAIL'}: {last}")
    else:
        report.append("- Metal-only tests (fused kernel vs portable path, mixed layers vs dequantized matmul): "
                      "need Apple silicon, not run here (the kernel's arithmetic is checked off-device by "
                      "tests/test_kernels.py's g++ harness)")
    for name, err, tol in path_checks():
        good = err <= tol
        ok &= good
        report.append(f"- {name}: relative error {err:.2e} (limit {tol:.0e}) {'pass' if good else 'FAIL'}")
    report.append(f"\ncorrectness: {'pass' if ok else 'FAIL'}\n")
    return ok


# ----------------------------------------------------------------------------- 2. matmul timings


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, calls alternated so that neighbours share the machine's load."""
    for fn in fns.values():
        mx.eval(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(repeats):
        order = list(fns.items())
        for k, fn in order[::-1] if rep % 2 else order:
            t = time.perf_counter()
            mx.eval(fn())
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def _layers(out_f: int, in_f: int) -> tuple[MixedLinear, MixedLinear]:
    w = mx.random.normal((out_f, in_f), key=mx.random.key(out_f + in_f)) * 0.02
    mixed = MixedLinear.from_quantized(quantize_weight(w, QuantOption.parse(MIXED), clip=False))
    uniform = MixedLinear.from_quantized(quantize_weight(w, QuantOption.parse(UNIFORM), clip=False))
    mx.eval(mixed.parameters(), uniform.parameters())
    return mixed, uniform


def _stock(layer: MixedLinear):
    """MLX's own quantized matmul on a uniform layer's arrays (what a stock mlx-lm 4-bit model runs)."""
    (w, s, b), = layer.parts
    return lambda x: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)


def time_shape(out_f: int, in_f: int, rows: int, repeats: int) -> list[dict]:
    """Timing rows of one shape and row count: one per path this backend has."""
    mixed, uniform = _layers(out_f, in_f)
    dtype = mx.float32 if kernels.backend() == "cpu" else mx.float16
    x = mx.random.normal((rows, in_f), key=mx.random.key(rows)).astype(dtype)
    if kernels.backend() == "cpu":
        runs = [("cached", True), ("streamed", False)]
    else:
        runs = [(kernels.matmul_path(rows, True), None)]
    out = []
    for label, cache in runs:
        kernels.set_cpu_cache(cache)
        try:
            stock = _stock(uniform)
            fns = {"mixed": lambda: mixed(x), "uniform": lambda: uniform(x)}
            if kernels.backend() != "cpu":
                fns["uniform"] = lambda: stock(x)
            med = interleaved_medians(fns, repeats)
        finally:
            kernels.set_cpu_cache(None)
            mixed.clear_cache()
            uniform.clear_cache()
        out.append({"shape": f"{out_f}x{in_f}", "rows": rows, "path": label, "mixed_ms": med["mixed"] * 1e3,
                    "uniform_ms": med["uniform"] * 1e3, "mixed_bytes": mixed.packed_bytes(),
                    "uniform_bytes": uniform.packed_bytes()})
    if kernels.backend() == "cpu" and rows == 1:  # stock 4-bit on the CPU: MLX's quantized matmul, decode only
        f = _stock(uniform)
        med = interleaved_medians({"uniform": lambda: f(x)}, repeats)
        out.append({"shape": f"{out_f}x{in_f}", "rows": rows, "path": "stock qmm (uniform only)", "mixed_ms": None,
                    "uniform_ms": med["uniform"] * 1e3, "mixed_bytes": None, "uniform_bytes": uniform.packed_bytes()})
    return out


def part_matmul(report: list[str], shapes: list[str], rows_list: list[int], repeats: int) -> None:
    """Part 2: the timing table, with each ratio against its goal."""
    metal = kernels.metal_active()
    report.append("## 2. Matmul: mixed vs uniform 4-bit at equal bytes\n")
    report.append(f"mixed `{MIXED}` vs uniform `{UNIFORM}` (both 4.5 bits per weight; the mixed one also stores "
                  f"a 2-byte permutation entry per input channel); median of {repeats} interleaved calls. "
                  + ("Uniform runs `mx.quantized_matmul`." if metal else
                     "Not Metal: this is the non-Metal reference; the goals apply to Metal. 'cached': the CPU "
                     "float32 cache (default); 'streamed': `MLX_DQ_CPU_CACHE=0`; uniform runs the same path "
                     "with one segment; 'stock qmm': MLX's CPU quantized matmul on the uniform weight."))
    report.append("\n| shape (out x in) | rows | path | mixed ms | uniform ms | mixed speed / uniform | goal |")
    report.append("|---|---:|---|---:|---:|---:|---|")
    for name in shapes:
        for out_f, in_f in SHAPES[name]:
            for rows in rows_list:
                for r in time_shape(out_f, in_f, rows, repeats):
                    report.append(_timing_row(name, r, metal))
                    print(report[-1], flush=True)
    report.append("")


def _timing_row(name: str, r: dict, metal: bool) -> str:
    kind = "decode" if r["rows"] <= kernels.DECODE_MAX_ROWS else "prefill"
    if r["mixed_ms"] is None:
        return (f"| {name} {r['shape']} | {r['rows']} | {r['path']} | - | {r['uniform_ms']:.3f} | - | - |")
    ratio = r["uniform_ms"] / r["mixed_ms"]
    goal = GOALS[kind]
    verdict = (f">= {goal:.0%}: {'met' if ratio >= goal else 'NOT met'}" if metal
               else f"(Metal goal >= {goal:.0%})")
    return (f"| {name} {r['shape']} | {r['rows']} | {r['path']} | {r['mixed_ms']:.3f} | {r['uniform_ms']:.3f} | "
            f"{ratio:.0%} | {verdict} |")


# ----------------------------------------------------------------------------- 3. generate

GEN_CHILD = r"""
import gc, json, os, resource, statistics, sys, time
from pathlib import Path
import mlx.core as mx
from mlx_dq.layers.kv_cache import generation_cache
folder, prompt, max_tokens, repeats = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
SCALE = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
def rss(key):
    try:
        return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key)][0]
    except (OSError, IndexError):
        return None
import mlx_lm
from mlx_lm.utils import load_model, load_tokenizer
from mlx_dq.layers.mixed import memory_note
from mlx_dq.loader import load, mixed_model_classes
load(folder)  # once, untimed and uncounted: imports and first-use allocations are not the model's
tok = load_tokenizer(folder)
mx.clear_cache()
base = rss("VmRSS:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * SCALE
def clear_hwm():
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: the peak from here on
        return True
    except OSError:
        return False
def hwm():
    return rss("VmHWM:") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * SCALE
reset = clear_hwm()
mx.reset_peak_memory()
active0 = mx.get_active_memory()
t = time.perf_counter()
# what mlx_dq.load does for the model (its tokenizer is loaded above, outside the measured span)
model, _ = load_model(folder, model_config={"model_file": None}, get_model_classes=mixed_model_classes)
load_s = time.perf_counter() - t
held_load = mx.get_active_memory() - active0
note = memory_note(model)
text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
runs, first = [], {}
for i in range(repeats + 1):  # the first run warms up (and builds the CPU cache when it is on)
    cache = generation_cache(model)  # what mlx_dq generate uses; passed in so that its bytes can be told apart from the model's
    last = None
    for last in mlx_lm.stream_generate(model, tok, text, max_tokens=max_tokens, prompt_cache=cache):
        pass
    kv = sum(c.nbytes for c in cache)
    del cache
    if i:
        runs.append((last.generation_tps, last.prompt_tps, last.generation_tokens, last.prompt_tokens))
        continue
    # peaks of loading + the first generation, then of the timed ones alone (the cache, when on, is built by now)
    first = {"mlx_peak_first": mx.get_peak_memory() - active0, "peak_rss_first": hwm()}
    mx.reset_peak_memory()
    reset = reset and clear_hwm()
mx.synchronize()
gc.collect()
held_gen = mx.get_active_memory() - active0
print("RESULT " + json.dumps({"load_s": load_s, "runs": runs, "tps": statistics.median(r[0] for r in runs),
      "prompt_tps": statistics.median(r[1] for r in runs), "tokens": runs[0][2], "prompt_tokens": runs[0][3],
      "held_load": held_load, "held_gen": held_gen, "mlx_peak": mx.get_peak_memory() - active0, "kv_bytes": kv,
      "base_rss": base, "peak_rss": hwm(), "hwm_reset": reset, "note": note, **first}))
"""

UNIFORM_CHILD = r"""
import sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.utils import quantize_model, save_config, save_model
from mlx_dq.model.sources import resolve
dst = Path(sys.argv[1])
src = resolve("smollm2-135m")
model, config = src.model(mx.float16), dict(src.config)
model, config = quantize_model(model, config, 64, 4)
dst.mkdir(parents=True)
save_model(dst, model)
save_config(config, config_path=dst / "config.json")
src.save_tokenizer(dst)
"""


def ensure_models(args: argparse.Namespace) -> tuple[Path, Path]:
    """The README's 3.5 bpw output and a uniform 4-bit g64 conversion (mlx-lm's own) of the same model, built
    under ``--work`` when not given."""
    work = Path(args.work)
    mixed = Path(args.mixed_model) if args.mixed_model else work / "smollm2-135m-3.5bpw"
    uniform = Path(args.uniform_model) if args.uniform_model else work / "smollm2-135m-4bit-g64"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not (mixed / "config.json").exists():
        print(f"building {mixed} (the README's command)", flush=True)
        subprocess.run([sys.executable, "-m", "mlx_dq", "convert", "--model", "smollm2-135m", "--bpw", "3.5",
                        "-o", str(mixed)], check=True, env=env)
    if not (uniform / "config.json").exists() and not args.skip_uniform:
        print(f"building {uniform} (mlx-lm 4-bit g64 of the same float16 source)", flush=True)
        subprocess.run([sys.executable, "-c", UNIFORM_CHILD, str(uniform)], check=True, env=env)
    return mixed, uniform


def generate_once(folder: Path, cache: bool | None, args: argparse.Namespace) -> dict:
    """Generation figures of ``folder`` in a fresh process (its own peak), the CPU cache on, off or unset."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(kernels.CPU_CACHE_ENV, None)
    if cache is not None:
        env[kernels.CPU_CACHE_ENV] = "1" if cache else "0"
    try:
        res = subprocess.run([sys.executable, "-c", GEN_CHILD, str(folder), PROMPT, str(args.max_tokens),
                              str(args.gen_repeats)], capture_output=True, text=True, env=env,
                             timeout=args.gen_timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": args.gen_timeout}
    if res.returncode != 0:
        raise SystemExit(f"generation with {folder} failed:\n{res.stderr[-3000:]}")
    out = json.loads([x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    out["file_bytes"] = sum(f.stat().st_size for f in folder.glob("model*.safetensors"))
    return out


def part_generate(report: list[str], args: argparse.Namespace) -> None:
    """Part 3: tok/s and memory of the mixed model (on the CPU: cache on and off) and uniform 4-bit."""
    mixed, uniform = ensure_models(args)
    runs = [("mixed 3.5 bpw", mixed, None), ("uniform 4-bit g64", uniform, None)]
    if kernels.backend() == "cpu":
        runs = [("mixed 3.5 bpw, CPU cache on", mixed, True), ("mixed 3.5 bpw, CPU cache off", mixed, False),
                ("uniform 4-bit g64 (stock layers)", uniform, None)]
    if args.skip_uniform:
        runs = [r for r in runs if r[1] != uniform]
    report.append("## 3. Generate\n")
    report.append(f"`mlx_dq.load`'s model + `mlx_lm.stream_generate`, chat-templated prompt {PROMPT!r}, "
                  f"{args.max_tokens} tokens, greedy; tok/s: median of {args.gen_repeats} runs after one warm-up run, "
                  "one process per row; (x) = of the weights file. Held: MLX arrays the loaded model keeps (after "
                  "loading; after every run, the KV cache dropped: the CPU cache included). MLX peak: arrays at the "
                  "peak (weights, KV cache, activations, transients), over loading + the warm-up run (which builds "
                  "the CPU cache when it is on), and over the timed runs alone. KV cache: mlx-lm's prompt cache at the "
                  "end of a run (`generation_cache`: float32 on the CPU with the CPU cache on, the weights' 16-bit "
                  "dtype with it off; allocated 256 positions at a time); peak - KV: the timed runs' "
                  "peak without it, i.e. what the model itself takes. RSS: the process's peak RSS over loading + the "
                  "warm-up run and over the timed runs (VmHWM, reset before each span; ru_maxrss over everything, "
                  "not resettable, on macOS) minus "
                  "its RSS before loading, which follows one untimed load of the same folder (imports, first-use "
                  "allocations; memory it freed may be reused, so this can read low: MLX peak is the firmer figure). "
                  f"Models: `{mixed}`" + ("" if args.skip_uniform else f", `{uniform}`") + ".\n")
    report.append("| model | weights file MiB | decode tok/s | prompt tok/s | held after load MiB | held after runs "
                  "MiB (x) | MLX peak, load + warm-up MiB (x) | MLX peak, timed runs MiB (x) | KV cache MiB | "
                  "timed peak - KV MiB (x) | RSS above load, load + warm-up MiB (x) | RSS above load, timed runs "
                  "MiB (x) |")
    report.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    for label, folder, cache in runs:
        r = generate_once(folder, cache, args)
        report.append(generate_row(label, r))
        print(report[-1], flush=True)
        if r.get("note"):
            notes.append(f"- {label}: `{r['note']}`")
    report += [""] + notes + [""]


def generate_row(label: str, r: dict) -> str:
    """One row of part 3's table from :func:`generate_once`'s figures (sizes in MiB, with their ratio to the file)."""
    if "timeout" in r:
        return f"| {label} | did not finish in {r['timeout']} s | | | | | | | | | | |"
    f = r["file_bytes"]

    def cell(n: float) -> str:
        return f"{n / (1 << 20):.1f} ({n / f:.2f}x)"

    return (f"| {label} | {f / (1 << 20):.1f} | {r['tps']:.1f} | {r['prompt_tps']:.1f} | "
            f"{r['held_load'] / (1 << 20):.1f} | {cell(r['held_gen'])} | {cell(r['mlx_peak_first'])} | "
            f"{cell(r['mlx_peak'])} | {r['kv_bytes'] / (1 << 20):.1f} | {cell(r['mlx_peak'] - r['kv_bytes'])} | "
            f"{cell(r['peak_rss_first'] - r['base_rss'])} | {cell(r['peak_rss'] - r['base_rss'])} |")


# ----------------------------------------------------------------------------- 4. scale


def part_scale(report: list[str], args: argparse.Namespace) -> None:
    """Part 4: ``scale.py``'s 8B shape on the default device, against its own matmul FLOP/s."""
    report.append("## 4. Cost at the Llama-3-8B shape (`benchmarks/scale.py --shapes 8b --layers 1 --rows 8`)\n")
    if not (kernels.metal_active() or args.scale):
        report.append("Not run: on this backend it takes hours (about 3 h on a 2-core CPU: "
                      "[scale_three_f474fb9.txt](scale_three_f474fb9.txt)); it is meant for the GPU. "
                      "`--scale` runs it anyway.\n")
        print(report[-1])
        return
    out = Path(args.work) / "scale_8b.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--shapes", "8b", "--layers", "1",
                          "--rows", "8", "--no-hot-loop", "--json", str(out)], capture_output=True, text=True)
    report.append("```\n" + res.stdout.strip() + "\n```\n")
    if res.returncode != 0:
        report.append(f"scale.py failed: {res.stderr[-1500:]}\n")
        return
    r = json.loads(out.read_text())
    s = r["shapes"]["8b"]
    flops = r["matmul_flops"]
    work = sum(st["macs"] for st in s["stages"] if st["stage"] != "head") / max(1, len(s["stages"]) - 1)
    floor = 2 * (work * s["shape"]["depth"] + s["stages"][-1]["macs"]) / flops
    conv = s.get("convert", {}).get("seconds", float("nan")) / 2 * (s["shape"]["depth"] + 1)
    report.append(f"- float32 matmul on this device: {flops / 1e9:.0f} GFLOP/s")
    report.append(f"- measure, extrapolated to 32 layers: {s['extrapolated_measure_s'] / 60:.1f} min; its counted "
                  f"work at the matmul's FLOP/s (the goal it is held to): {floor / 60:.1f} min "
                  f"({floor / s['extrapolated_measure_s']:.0%} of matmul speed)")
    report.append(f"- convert at 3.5 bpw, extrapolated to 32 layers: {conv / 60:.1f} min\n")


# ----------------------------------------------------------------------------- report


def machine() -> list[str]:
    """Chip, OS, MLX and mlx-lm versions, backend, commit, load: the header of a section."""
    if sys.platform == "darwin":
        chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                              text=True).stdout.strip()
        osname = f"macOS {platform.mac_ver()[0]}"
    else:
        cpu = [x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name")] \
            if Path("/proc/cpuinfo").exists() else []
        chip = (cpu[0].split(":", 1)[1].strip() if cpu else platform.processor()) + f", {os.cpu_count()} cores"
        osname = platform.platform()
    import mlx_lm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return [f"- chip: {chip}", f"- OS: {osname}", f"- MLX {mx.__version__}, mlx-lm {mlx_lm.__version__}, "
            f"default device {mx.default_device()}, backend `{kernels.backend()}`",
            f"- code: {commit or 'unknown'} (plus uncommitted changes, if any); {time.strftime('%Y-%m-%d %H:%M')}",
            f"- load average at start: {', '.join(f'{v:.1f}' for v in load) if load else 'unknown'} "
            "(a shared machine slows every figure; ratios of interleaved calls are the firmer figures)"]


def merge_section(old: str, key: str, body: str) -> str:
    """``old`` with this backend's section (marked ``SECTION.format(key)``) replaced by ``body``, others kept."""
    marker = SECTION.format(key)
    head = "# apple_check results\n\nWritten by `python benchmarks/apple_check.py`; one section per backend.\n"
    if not old.strip():
        old = head
    parts = old.split("<!-- apple_check:")
    keep = [p for p in parts[1:] if not p.startswith(key + " -->")]
    text = parts[0].rstrip("\n") + "\n\n" + marker + "\n" + body.strip("\n") + "\n"
    return text + "".join("\n<!-- apple_check:" + p.rstrip("\n") + "\n" for p in keep)


def main(argv: list[str] | None = None) -> int:
    """Run the parts this backend can run, write the results section, return the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "apple_silicon.md"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats (a smoke run)")
    ap.add_argument("--shapes", default=None, help="comma-separated: " + ",".join(SHAPES)
                    + " (default: smollm2,8b,70b on a GPU, smollm2,8b on the CPU)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per matmul figure (median; default 9)")
    ap.add_argument("--gen-repeats", type=int, default=3, help="timed generations per model (median)")
    ap.add_argument("--gen-timeout", type=int, default=1800, help="seconds one model's generations may take")
    ap.add_argument("--skip-tests", action="store_true", help="skip part 1's pytest run")
    ap.add_argument("--skip-matmul", action="store_true")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--scale", action="store_true", help="run part 4 off Metal too (hours on a CPU)")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--mixed-model", default=None, help="the README's 3.5 bpw output (built when absent)")
    ap.add_argument("--uniform-model", default=None, help="a uniform 4-bit conversion (built when absent)")
    ap.add_argument("--skip-uniform", action="store_true",
                    help="part 3 without the uniform model (MLX's CPU quantized matmul: minutes per run on a CPU)")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "mlx_dq" / "apple_check"))
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    where = kernels.backend()
    shapes = (args.shapes or ("tiny" if args.quick else "smollm2,8b" if where == "cpu" else "smollm2,8b,70b"))
    repeats = args.repeats or (3 if args.quick else 9)
    title = {"metal": "Apple silicon (Metal)", "gpu": "another GPU backend", "cpu": "non-Metal reference (CPU)"}
    report = [f"## Run on {title[where]}\n"] + machine() + [""]
    print("\n".join(report), flush=True)
    if where != "metal":
        report.append("Not Apple silicon: the Metal-only tests, the fused kernel's timings and the Metal goals "
                      "need Apple silicon; every part that can run here ran.\n")
        print(report[-1], flush=True)
    ok = part_correctness(report) if not args.skip_tests else True
    if not args.skip_matmul:
        part_matmul(report, shapes.split(","), [1, 512] if not args.quick else [1, 64], repeats)
    if not args.skip_generate:
        part_generate(report, args)
    if not args.skip_scale:
        part_scale(report, args)
    end = os.getloadavg() if hasattr(os, "getloadavg") else None
    report.append(f"load average at end: {', '.join(f'{v:.1f}' for v in end) if end else 'unknown'}\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = "\n".join(report)
    out.write_text(merge_section(out.read_text() if out.exists() else "", where, body))
    print(f"\n{'correctness: pass' if ok else 'correctness: FAIL'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
