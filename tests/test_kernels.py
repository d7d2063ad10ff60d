"""The fused Metal kernel, verified without a Mac, and the portable helpers.

The Metal source that MLX generates for our kernel call (captured with
``mx.export_function``; it contains ``kernels.KERNEL_SOURCE`` verbatim) is compiled
with g++ inside a harness that emulates the few Metal builtins it uses, then run
on random inputs and compared with a numpy float64 dequantize-then-matmul
reference. A last test runs the real kernel on Apple silicon and skips elsewhere.
"""

from __future__ import annotations

import ctypes
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

from mlx_dq.layers import kernels

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)

# ----------------------------------------------------------------------------- numpy reference


def np_unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Codes of little-endian bit streams in uint32 words (one stream per row)."""
    raw = np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=-1, bitorder="little")
    raw = raw.reshape(*packed.shape[:-1], -1, bits).astype(np.int64)
    return raw @ (1 << np.arange(bits, dtype=np.int64))


def np_dequant(parts, bits, group_sizes, perm) -> np.ndarray:
    """float64 weight in original channel order from stored segments."""
    cols = []
    for (w, s, b), nb, g in zip(parts, bits, group_sizes):
        q = np_unpack(w, nb).astype(np.float64)
        s64 = np.repeat(_f64(s), g, axis=-1)
        b64 = np.repeat(_f64(b), g, axis=-1)
        cols.append(q * s64 + b64)
    wq = np.concatenate(cols, axis=-1)
    out = np.empty_like(wq)
    out[..., perm.astype(np.int64)] = wq
    return out


def _f64(a) -> np.ndarray:
    if isinstance(a, mx.array):
        a = np.array(a.astype(mx.float32))
    return a.astype(np.float64)


def _np(a: mx.array) -> np.ndarray:
    """Raw numpy copy of an MLX array (bfloat16 as its uint16 bit pattern)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    bits: list[int]
    groups: list[int]
    widths: list[int]
    n: int
    rows: int
    x_dtype: mx.Dtype = mx.float32
    scale_dtype: mx.Dtype = mx.float16
    perm_dtype: mx.Dtype = mx.uint16
    seed: int = 0
    data: dict = field(default_factory=dict)

    def build(self) -> None:
        """Random weight segments (quantized by MLX), permutation and x."""
        mx.random.seed(self.seed)
        k = sum(self.widths)
        parts = []
        for nb, g, wd in zip(self.bits, self.groups, self.widths):
            w = mx.random.normal((self.n, wd)).astype(self.scale_dtype)
            parts.append(mx.quantize(w, group_size=g, bits=nb))
        perm = mx.array(np.random.default_rng(self.seed).permutation(k)).astype(self.perm_dtype)
        x = mx.random.normal((self.rows, k)).astype(self.x_dtype)
        mx.eval(parts, perm, x)
        self.data = {"x": x, "perm": perm, "parts": parts}


def _random_mixed(rng: random.Random, idx: int) -> Case:
    nseg = rng.randint(2, 6)
    bits = sorted(rng.sample(BITS, nseg), reverse=True)
    groups = [rng.choice(GROUPS) for _ in bits]
    widths = [g * rng.randint(1, 5) for g in groups]
    x_dtype = rng.choice([mx.float32, mx.float16, mx.bfloat16])
    scale_dtype = rng.choice([mx.float16, mx.bfloat16])
    return Case(
        f"mixed{idx}", bits, groups, widths, n=rng.randrange(1, 40, 2), rows=rng.randint(1, 8),
        x_dtype=x_dtype, scale_dtype=scale_dtype, seed=100 + idx,
    )


def _cases() -> list[Case]:
    cases = [
        Case(f"u{b}b_{g}g", [b], [g], [2 * g + 128], n=13, rows=1 + (b + g) % 8, seed=b * 1000 + g)
        for b in BITS
        for g in GROUPS
    ]
    rng = random.Random(1234)
    cases += [_random_mixed(rng, i) for i in range(10)]
    # more than 32 chunks per segment (lanes loop), boundary off 512, uint32 permutation
    cases.append(Case("wide", [5, 3], [32, 64], [1056, 1088], n=7, rows=8, perm_dtype=mx.uint32, seed=7))
    cases.append(Case("wide2", [8, 4, 2], [128, 32, 64], [1280, 64, 1152], n=5, rows=2, x_dtype=mx.float16,
                      scale_dtype=mx.bfloat16, seed=9))
    cases.append(Case("one_row", [6, 4, 2], [64, 32, 128], [192, 96, 256], n=1, rows=3, seed=8))
    return cases


CASES = _cases()

# ----------------------------------------------------------------------------- C++ harness

HARNESS_PRELUDE = r"""
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

typedef _Float16 float16_t;
struct bfloat16_t {
  uint16_t v;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    v = (uint16_t)(u >> 16);
  }
  operator float() const {
    uint32_t u = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef uint32_t uint;
struct uint3 { uint x, y, z; };
#define device
#define constant

namespace emu {
std::barrier<>* bar = nullptr;
float slots[32];
thread_local uint lane = 0;
}  // namespace emu

namespace metal {
// 32 lanes of one simdgroup are 32 threads; the sum is taken in lane order.
inline float simd_sum(float v) {
  emu::slots[emu::lane] = v;
  emu::bar->arrive_and_wait();
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += emu::slots[i];
  emu::bar->arrive_and_wait();
  return s;
}
}  // namespace metal

// grid (32, rows, 1): one simdgroup per grid row, its 32 lanes run concurrently.
template <class F>
static void launch(uint rows, F f) {
  std::barrier<> bar(32);
  emu::bar = &bar;
  std::vector<std::thread> lanes;
  for (uint l = 0; l < 32; ++l) {
    lanes.emplace_back([&, l] {
      emu::lane = l;
      for (uint r = 0; r < rows; ++r) f(l, r);
    });
  }
  for (auto& t : lanes) t.join();
}
"""

_ATTRS = {
    "thread_index_in_simdgroup": "lane",
    "thread_position_in_grid": "uint3{lane, row, 0u}",
}


def split_generated(src: str) -> tuple[str, str, str, list[tuple[str, str, str]]]:
    """(kernel definition, kernel name, template arguments, [(type, name, attribute)]) of MLX's source."""
    inst = [ln for ln in src.splitlines() if ln.startswith("template [[host_name(")]
    assert len(inst) == 1, src[-2000:]
    definition = src[: src.index(inst[0])]
    name = re.search(r"\[\[kernel\]\] void (\w+)\(", definition).group(1)
    targs = re.search(r"decltype\(\w+<(.*)>\)", inst[0]).group(1)
    head = definition[definition.index(name + "(") + len(name) + 1 : definition.index(") {")]
    params = []
    for p in head.split(",\n"):
        m = re.match(r"\s*(.*?)\s*(\w+)\s*\[\[(\w+)(?:\(\d+\))?\]\]\s*$", p)
        assert m, p
        params.append((m.group(1), m.group(2), m.group(3)))
    return definition, name, targs, params


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Compile MLX's generated source for every case into one shared library."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not available to compile the kernel source")
    defs, wrappers, seen = [], [], set()
    for i, case in enumerate(CASES):
        case.build()
        d = case.data
        src = kernels.generated_metal_source(d["x"], d["perm"], d["parts"], case.bits, case.groups)
        definition, name, targs, params = split_generated(src)
        case.data["source"] = src
        if name not in seen:
            seen.add(name)
            defs.append(definition)
        args, nbuf = [], 0
        for typ, pname, attr in params:
            if attr == "buffer":
                args.append(f"({typ})bufs[{nbuf}]")
                nbuf += 1
            else:
                assert pname in _ATTRS, f"kernel uses Metal attribute {pname} the harness does not emulate"
                args.append(_ATTRS[pname])
        case.data["nbuf"] = nbuf
        wrappers.append(
            f'extern "C" void run_case_{i}(void** bufs) {{\n'
            f"  launch({case.n}u, [&](uint lane, uint row) {{ {name}<{targs}>({', '.join(args)}); }});\n}}\n"
        )
    tmp = tmp_path_factory.mktemp("kernel")
    cpp, lib = tmp / "harness.cpp", tmp / "harness.so"
    cpp.write_text(HARNESS_PRELUDE + "\n".join(defs) + "\n" + "\n".join(wrappers))
    res = subprocess.run(
        ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-attributes", "-o", str(lib), str(cpp)],
        capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return ctypes.CDLL(str(lib))


def run_compiled(lib, i: int, case: Case, parts=None) -> np.ndarray:
    """Run case ``i`` through the compiled kernel; output as float64."""
    d = case.data
    parts = d["parts"] if parts is None else parts
    flat = [p for j in range(kernels.MAX_SEGMENTS) for p in (parts[j] if j < len(parts) else parts[0])]
    arrays = [np.ascontiguousarray(_np(a)) if isinstance(a, mx.array) else a for a in [d["x"], d["perm"], *flat]]
    out = np.zeros((case.rows, case.n), dtype=np.uint16 if case.x_dtype != mx.float32 else np.float32)
    ptrs = (ctypes.c_void_p * (len(arrays) + 1))(*[a.ctypes.data for a in arrays], out.ctypes.data)
    assert d["nbuf"] == len(arrays) + 1
    getattr(lib, f"run_case_{i}")(ptrs)
    if case.x_dtype == mx.float16:
        return out.view(np.float16).astype(np.float64)
    if case.x_dtype == mx.bfloat16:
        return (out.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return out.astype(np.float64)


def reference(case: Case, parts=None) -> np.ndarray:
    """numpy float64 dequantize-then-matmul."""
    d = case.data
    parts = d["parts"] if parts is None else parts
    np_parts = [(np.array(w), s, b) for w, s, b in parts]
    wq = np_dequant(np_parts, case.bits, case.groups, np.array(d["perm"]))
    return _f64(d["x"]) @ wq.T


TOL = {mx.float32: 2e-6, mx.float16: 1e-3, mx.bfloat16: 4e-3}


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.name for c in CASES])
def test_compiled_kernel_matches_numpy(harness, i):
    """The g++-compiled generated kernel equals numpy dequantize-then-matmul."""
    case = CASES[i]
    got = run_compiled(harness, i, case)
    ref = reference(case)
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
    assert err <= TOL[case.x_dtype], f"{case.name}: relative error {err:.3g}"


def test_compiled_kernel_detects_a_flipped_bit(harness):
    """The comparison is sensitive: one flipped code bit in a 3-bit word-crossing code shows up."""
    i = next(j for j, c in enumerate(CASES) if c.name == "u3b_32g")
    case = CASES[i]
    w, s, b = case.data["parts"][0]
    w_np = np.array(w).copy()
    w_np[0, 0] ^= np.uint32(1 << 31)  # code 10 of row 0 spans words 0 and 1
    bad = [(mx.array(w_np), s, b)]
    got = run_compiled(harness, i, case, parts=bad)
    assert not np.allclose(got, reference(case), rtol=0, atol=1e-4)
    np.testing.assert_allclose(got, reference(case, parts=bad), rtol=1e-5, atol=1e-5)


def test_generated_source_contains_kernel_body_and_template():
    """MLX's generated Metal source holds our body verbatim, our template arguments and buffer types."""
    case = next(c for c in CASES if c.name == "wide")
    case.build()
    d = case.data
    src = kernels.generated_metal_source(d["x"], d["perm"], d["parts"], case.bits, case.groups)
    assert kernels.KERNEL_SOURCE.strip() in src
    _, _, targs, params = split_generated(src)
    expect = kernels.kernel_template(mx.float32, case.rows, case.n, sum(case.widths), case.bits, case.groups,
                                     case.widths)
    assert targs.split(", ") == ["float"] + [str(v) for _, v in expect[1:]]
    types = {name: typ for typ, name, _ in params}
    assert types["x"] == "const device float*"
    assert types["perm"] == "const device uint32_t*"
    assert types["w0"] == "const device uint32_t*" and types["s0"] == "const device float16_t*"
    assert types["out"] == "device float*"


def test_kernel_template_rejects_bad_calls():
    """Too many rows or segments, or widths not adding to K, raise ValueError."""
    with pytest.raises(ValueError, match="rows"):
        kernels.kernel_template(mx.float32, 9, 4, 64, [4], [32], [64])
    with pytest.raises(ValueError, match="segments"):
        kernels.kernel_template(mx.float32, 1, 4, 64, [8, 6, 5, 4, 3, 2, 1], [32] * 7, [32] * 7)
    with pytest.raises(ValueError, match="widths"):
        kernels.kernel_template(mx.float32, 1, 4, 64, [4], [32], [32])


def test_dequantize_parts_matches_numpy():
    """The portable fp32 dequantization equals the numpy reference."""
    case = next(c for c in CASES if c.name == "mixed3")
    case.build()
    d = case.data
    got = np.array(kernels.dequantize_parts(d["parts"], case.bits, case.groups, d["perm"]))
    ref = np_dequant([(np.array(w), s, b) for w, s, b in d["parts"]], case.bits, case.groups, np.array(d["perm"]))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.metal
@pytest.mark.skipif(not kernels.metal_active(), reason="needs Apple silicon with Metal")
@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.name for c in CASES])
def test_metal_kernel_matches_portable(i):
    """On Apple silicon: the real fused kernel and per-segment path equal the dequantized matmul."""
    case = CASES[i]
    case.build()
    d = case.data
    got = kernels.fused_mixed_matmul(d["x"], d["perm"], d["parts"], case.bits, case.groups).astype(mx.float32)
    w = kernels.dequantize_parts(d["parts"], case.bits, case.groups, d["perm"])
    ref = d["x"].astype(mx.float32) @ w.T
    err = (mx.abs(got - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6)).item()
    assert err <= TOL[case.x_dtype] * 2, f"{case.name}: relative error {err:.3g}"
    seg = kernels.segmented_quantized_matmul(d["x"], d["perm"], d["parts"], case.bits, case.groups)
    err_seg = (mx.abs(seg.astype(mx.float32) - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6)).item()
    assert err_seg <= TOL[case.x_dtype] * 4, f"{case.name}: segmented relative error {err_seg:.3g}"


def test_launch_geometry_is_what_the_harness_emulates(monkeypatch):
    """The kernel is launched as the harness runs it: grid (32, N, 1), 32-wide threadgroups, out (rows, N)."""
    seen = {}

    def record(**kwargs):
        seen.update(kwargs)
        return [mx.zeros(kwargs["output_shapes"][0], dtype=kwargs["output_dtypes"][0])]

    monkeypatch.setattr(kernels, "_get_kernel", lambda: record)
    case = next(c for c in CASES if c.name == "wide")
    case.build()
    d = case.data
    x3 = d["x"].reshape(2, 4, -1)
    y = kernels.fused_mixed_matmul(x3, d["perm"], d["parts"], case.bits, case.groups)
    assert y.shape == (2, 4, case.n)
    assert seen["grid"] == (kernels.SIMD_WIDTH, case.n, 1)
    assert seen["threadgroup"][0] == kernels.SIMD_WIDTH and seen["threadgroup"][2] == 1
    assert seen["output_shapes"] == [(case.rows, case.n)]
    assert [n for n, _ in seen["template"]][:4] == ["T", "M", "N", "K"]
    assert len(seen["inputs"]) == len(kernels.KERNEL_INPUTS)
