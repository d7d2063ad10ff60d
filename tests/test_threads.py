"""Per-tensor work on several threads: the same numbers as on one, for measurement and conversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_dq.conversion.pipeline import convert
from mlx_dq.measure.records import measurement_to_json
from mlx_dq.measure.stream import measure, strip_timing
from mlx_dq.runtime import threads
from mlx_dq.runtime.threads import thread_map, workers


def test_thread_map_keeps_order_and_takes_lazy_inputs():
    """Lazy arrays from the calling thread reach the workers evaluated; results come back in order, evaluated."""
    items = [(mx.arange(100, dtype=mx.float32) * i, i) for i in range(6)]  # lazy: made on this thread's stream
    seen = set()

    def fn(x: mx.array, i: int) -> tuple[mx.array, int]:
        seen.add(threading.get_ident())
        return x.sum() * 2, i

    got = thread_map(fn, items, 3)
    assert [i for _, i in got] == list(range(6))
    assert [float(v.item()) for v, _ in got] == [2 * 4950.0 * i for i in range(6)]
    assert threading.get_ident() not in seen  # the work ran on the workers


def test_workers_follow_the_environment(monkeypatch):
    monkeypatch.setenv(threads.ENV, "1")
    assert workers() == 1
    monkeypatch.setenv(threads.ENV, "3")
    assert workers() == 3
    monkeypatch.setenv(threads.ENV, "two")
    with pytest.raises(ValueError, match=threads.ENV):
        workers()
    monkeypatch.delenv(threads.ENV)
    assert 1 <= workers() <= threads.MAX_WORKERS


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe"])
def test_measurement_is_the_same_on_one_or_several_threads(fixture, request, monkeypatch):
    folder = request.getfixturevalue(fixture)
    docs = []
    for n in ("1", "3"):
        monkeypatch.setenv(threads.ENV, n)
        m = measure(str(folder), rows=4, seq_len=32, batch_size=2, importance_rows=2, sample_rows=16, progress=False)
        docs.append(json.dumps(strip_timing(measurement_to_json(m)), sort_keys=True))
    assert docs[0] == docs[1]


def test_conversion_is_the_same_on_one_or_several_threads(tiny_llama, tmp_path, monkeypatch):
    plan = {f"model.layers.{i}.{p}": d for i in range(2) for p, d in (
        ("self_attn.q_proj", "1.0:3b_64g"), ("self_attn.k_proj", "0.25:4b_32g/0.75:3b_32g"),
        ("self_attn.v_proj", "1.0:4b_32g"), ("self_attn.o_proj", "1.0:2b_64g"), ("mlp.gate_proj", "1.0:5b_64g"),
        ("mlp.up_proj", "1.0:4b_64g"), ("mlp.down_proj", "0.5:4b_64g/0.5:3b_64g"))}
    arrays = []
    for n in ("1", "3"):
        monkeypatch.setenv(threads.ENV, n)
        out = tmp_path / f"t{n}"
        convert(str(tiny_llama), out, plan=plan, rows=4, seq_len=32, progress=False)
        arrays.append(mx.load(str(out / "model.safetensors")))
    assert arrays[0].keys() == arrays[1].keys()
    for k in arrays[0]:
        np.testing.assert_array_equal(np.array(arrays[0][k]), np.array(arrays[1][k]), err_msg=k)


def test_thread_map_starts_the_costliest_first():
    started = []

    def fn(i: int) -> int:
        started.append(i)
        return i * i

    assert thread_map(fn, [0, 1, 2, 3, 4], 2, cost=lambda i: i) == [0, 1, 4, 9, 16]
    assert started[:2] and set(started[:2]) == {4, 3}  # the two dearest went to the two threads first


def test_results_arrays_are_found_inside_nested_objects():
    from dataclasses import dataclass

    from mlx_dq.runtime.threads import _arrays

    @dataclass
    class Inner:
        parts: list

    @dataclass
    class Outer:
        ids: object
        inner: Inner

    a, b, c = mx.array([1.0]), mx.array([2.0]), mx.array([3.0])
    found = _arrays((Inner([(a, b)]), None, Outer(ids=[1, 2], inner=Inner([(c,)]))))
    assert sorted(float(x.item()) for x in found) == [1.0, 2.0, 3.0]


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _mlx_work(i: int) -> mx.array:
    return mx.exp(mx.arange(64, dtype=mx.float32) * i).sum()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_repeated_calls_leave_no_threads_behind():
    """MLX keeps a stream thread for every thread that ran its work: the workers must be reused, not made per call."""
    list(threads.map_ahead(_mlx_work, list(range(6)), 2))
    thread_map(_mlx_work, list(range(6)), 2)
    before = _os_threads()
    for _ in range(5):
        assert len(list(threads.map_ahead(_mlx_work, list(range(6)), 2))) == 6
        assert len(thread_map(_mlx_work, list(range(6)), 2)) == 6
    assert _os_threads() == before


def test_a_failed_item_is_raised_after_the_running_ones_finish():
    running, finished = set(), set()

    def fn(i: int) -> int:
        running.add(i)
        if i == 1:
            raise RuntimeError("item 1 failed")
        time.sleep(0.05)
        finished.add(i)
        return i

    with pytest.raises(RuntimeError, match="item 1"):
        thread_map(fn, list(range(8)), 2)
    assert running - finished == {1}  # nothing still running once the error is raised
    assert thread_map(lambda i: i + 1, [1, 2, 3], 2) == [2, 3, 4]  # the workers still serve later calls


def test_a_script_using_the_workers_exits_cleanly():
    """Each worker clears its MLX streams before it ends; without that, short scripts aborted at exit (status 134)."""
    script = ("import numpy as np\nfrom mlx_dq.quant.scale_search import choose_group_params\n"  # 4 row chunks on the workers
              "w = np.random.default_rng(0).standard_normal((1, 4096, 16, 64)).astype(np.float32)\n"
              "print(choose_group_params(w, 4, weight=np.ones((1, 1, 16, 64), np.float32))[0].shape[1])\n")
    for _ in range(3):  # the abort was not every time (4 runs in 6)
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert (run.returncode, run.stdout.split()) == (0, ["4096"]), run.stderr[-500:]


def test_idle_workers_hold_nothing_of_their_last_call():
    """The workers serving the main thread outlive each call: an idle one must not keep its last arguments or result
    (a kept 14,336 x 4,096 weight raised an 8B-shape conversion's peak by 340 MB)."""
    import gc
    import weakref

    class Big:
        pass

    items = [Big() for _ in range(4)]
    out = thread_map(lambda b: Big(), items, 2)
    refs = [weakref.ref(x) for x in items + out]
    del items, out
    gc.collect()
    assert [r() for r in refs] == [None] * 8
