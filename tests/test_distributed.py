"""Distributed measure/convert: two ranks under ``mlx.launch`` (ring backend, localhost) against one process.

The two-rank runs must give the very same measurement and the very same
converted folder as one process, byte for byte (timing fields aside): rank
blocks of calibration batches are contiguous and their Gram matrices are
added in the one-process order. A rank killed mid-run must leave a
measurement that the same command resumes to that same result.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from fixtures_models import make_tiny_model_folder

from mlx_dq.cli import main
from mlx_dq.measure.records import OptionRecord, TensorRecord, load_measurement
from mlx_dq.measure.stream import measure, strip_timing
from mlx_dq.quant.options import QuantOption
from mlx_dq.runtime import distributed as dist

GRID = {"default": ["1.0:3b_64g", "0.5:4b_32g/0.5:3b_64g", "1.0:4b_32g"]}  # GPTQ, mixed and uniform
ROWS, SEQ_LEN = 8, 32  # two batches of four rows: one per rank
REPO = Path(__file__).resolve().parents[1]


def _launcher() -> list[str] | None:
    """The command that runs ``mlx.launch`` with this interpreter, or None when MLX has no launcher."""
    try:
        from mlx._distributed_utils import launch  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


LAUNCH = _launcher()
pytestmark = pytest.mark.skipif(LAUNCH is None, reason="this MLX build has no mlx.launch (mlx._distributed_utils)")


def _free_port() -> int:
    """A port where the two ring ranks (port, port + 1) can probably listen."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            try:
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    return 41000


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # the ranks inherit this process's BLAS threading: OpenBLAS results depend on the thread count
    return env


def _launch(args: list[str], cwd: Path, n: int = 2) -> subprocess.Popen:
    cmd = LAUNCH + ["-n", str(n), "--backend", "ring", "-p", str(_free_port()),
                    sys.executable, "-m", "mlx_dq", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run(args: list[str], cwd: Path, n: int = 2, timeout: float = 240) -> str:
    p = _launch(args, cwd, n)
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0 and "Error" not in out, out[-3000:]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny tied llama, a small grid, and the one-process measurement and conversion to compare with."""
    tmp = tmp_path_factory.mktemp("dist")
    folder = make_tiny_model_folder(tmp, "llama", num_layers=3, tie=True)
    grid = tmp / "grid.json"
    grid.write_text(json.dumps({"description": "test grid", "roles": GRID}))
    single = tmp / "single.json"
    measure(str(folder), grid=str(grid), rows=ROWS, seq_len=SEQ_LEN, out_path=single, progress=False)
    conv = tmp / "single-out"  # converted through the same command as the two ranks', so the cards match too
    res = CliRunner().invoke(main, ["convert", "--model", str(folder), "--bpw", "3.5", "--rows", str(ROWS),
                                    "--seq-len", str(SEQ_LEN), "--measurement", str(single), "-o", str(conv)])
    assert res.exit_code == 0, res.output
    return {"tmp": tmp, "folder": folder, "grid": grid, "single": single, "conv": conv}


def _measure_args(s: dict, out: Path) -> list[str]:
    return ["measure", "--model", str(s["folder"]), "--grid", str(s["grid"]), "--rows", str(ROWS),
            "--seq-len", str(SEQ_LEN), "-o", str(out)]


def _same_measurement(a: Path, b: Path) -> None:
    da, db = (strip_timing(json.loads(p.read_text())) for p in (a, b))
    assert da == db


def _same_conversion(one: Path, two: Path, renames: list[tuple[bytes, bytes]]) -> list[str]:
    """Assert two converted folders hold the same files, byte for byte but for their timings; their names.

    ``renames``: (in ``one``, in ``two``) byte strings, e.g. the output folder and measurement file that the card
    and the manifest name."""
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    # the only fields that differ: wall-clock times, and the digest of a measurement file that holds its timings
    timing = {"mlx_dq.json": [("provenance", "quantization_seconds"), ("provenance", "measurement", "sha256")],
              "plan.json": [("wall_s",)]}
    for name in names:
        a, b = (one / name).read_bytes(), (two / name).read_bytes()
        for x, y in renames:
            a = a.replace(x, y)
        if name in timing:
            da, db = json.loads(a), json.loads(b)
            for doc in (da, db):
                for field in timing[name]:
                    d = doc
                    for k in field[:-1]:
                        d = d[k]
                    d.pop(field[-1])
            assert da == db, name
        elif name == "measurement.json":
            assert strip_timing(json.loads(a)) == strip_timing(json.loads(b))
        else:
            assert a == b, f"{name} differs between one process and two ranks"
    return names


def test_two_ranks_measure_and_convert_byte_identical_to_one_process(setup):
    s, tmp = setup, setup["tmp"]
    out = tmp / "two.json"
    _run(_measure_args(s, out), tmp)
    _same_measurement(s["single"], out)  # every float equal, not merely close
    assert not list(tmp.glob("two.json.state*")), "resume states must be removed when the run completes"

    conv = tmp / "two-out"
    log = _run(["convert", "--model", str(s["folder"]), "--bpw", "3.5", "--rows", str(ROWS), "--seq-len",
                str(SEQ_LEN), "--measurement", str(out), "-o", str(conv)], tmp)
    assert log.count("wrote ") == 1  # rank 0 reports and writes
    names = _same_conversion(s["conv"], conv, [(b"single-out", b"two-out"), (b"single.json", b"two.json")])
    assert any(n.endswith(".safetensors") for n in names)


def test_one_rank_launch_equals_one_process(setup):
    s, tmp = setup, setup["tmp"]
    out = tmp / "one.json"
    _run(_measure_args(s, out), tmp, n=1)
    _same_measurement(s["single"], out)


SAMPLE_ROWS = 128  # no decoder tensor of the tiny model has more rows; the head's sample: 8 x 128 + the looked-up
PADDED_VOCAB = 2048  # the embedding's rows, most never looked up (as in models whose vocabulary is padded)


def _pad_vocab(folder: Path, vocab: int) -> None:
    """Give the model ``vocab`` embedding (and head) rows, the new ones random: a table large enough to be sampled
    (the tiny tokenizer cannot have that many tokens)."""
    path = folder / "model.safetensors"
    weights = mx.load(str(path))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            w = weights[name]
            extra = 0.02 * mx.random.normal((vocab - w.shape[0], w.shape[1]), key=mx.random.key(1))
            weights[name] = mx.concatenate([w, extra.astype(w.dtype)])
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}, indent=2))


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def sampled(request, tmp_path_factory) -> dict:
    """The README command's settings on a tiny llama: the default grid, the default row sampling of the head (its
    table large enough to be sampled), frequent-token rows at conversion; one process's measurement of it."""
    tied = request.param
    tmp = tmp_path_factory.mktemp("dist-sampled-" + ("tied" if tied else "untied"))
    folder = make_tiny_model_folder(tmp, "llama", num_layers=2, hidden=64, intermediate=128, tie=tied)
    _pad_vocab(folder, PADDED_VOCAB)
    single = tmp / "single.json"
    measure(str(folder), rows=ROWS, seq_len=SEQ_LEN, sample_rows=SAMPLE_ROWS, out_path=single, progress=False)
    return {"tmp": tmp, "folder": folder, "single": single, "tied": tied}


def test_two_ranks_equal_one_with_a_sampled_head(sampled):
    """The embedding/head stage, too, gives the same record on two ranks as on one (issue: the tied head's
    options differed by 0.1-4% between one and two ranks)."""
    s, tmp = sampled, sampled["tmp"]
    one = load_measurement(s["single"])
    head = one.tensors["model.embed_tokens" if s["tied"] else "lm_head"]
    assert head.extra["sampled_rows"] < head.shape[0] and head.extra.get("head_anchors"), head.extra  # this path
    assert len(head.options) > 4  # the default grid's options, not a test grid's few
    out = tmp / "two.json"
    _run(["measure", "--model", str(s["folder"]), "--rows", str(ROWS), "--seq-len", str(SEQ_LEN),
          "--sample-rows", str(SAMPLE_ROWS), "-o", str(out)], tmp)
    _same_measurement(s["single"], out)  # every float equal, not merely close
    if not s["tied"]:
        return
    outs = {}
    for n, name in ((1, "one-out"), (2, "two-out")):  # frequent-token rows (the default) from the same measurement
        outs[n] = tmp / name
        log = _run(["convert", "--model", str(s["folder"]), "--bpw", "3.5", "--rows", str(ROWS), "--seq-len",
                    str(SEQ_LEN), "--measurement", str(s["single"]), "-o", str(outs[n])], tmp, n=n)
        assert log.count("wrote ") == 1
    _same_conversion(outs[1], outs[2], [(b"one-out", b"two-out")])
    manifest = json.loads((outs[2] / "mlx_dq.json").read_text())
    assert "model.embed_tokens" in manifest["row_split_modules"]  # the embedding was stored with frequent-token rows


def _rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """Rank -> pid of the processes the launcher started (read from their MLX_RANK)."""
    found = {}
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    kids = [int(pid) for pid, ppid in (line.split() for line in out.splitlines()) if int(ppid) == launcher.pid]
    for pid in kids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            r = next(int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"MLX_RANK="))
        except (OSError, StopIteration, ValueError):
            r = len(found)  # no /proc (macOS): ranks start in order
        found[r] = pid
    return found


def test_killed_rank_stops_the_job_and_measurement_resumes(setup):
    s, tmp = setup, setup["tmp"]
    out = tmp / "killed.json"
    p = _launch(_measure_args(s, out), tmp)
    deadline = time.time() + 180
    killed = False
    while time.time() < deadline and p.poll() is None:
        if out.exists():
            doc = json.loads(out.read_text())
            if doc["last_module_idx"] is not None and doc["last_module_idx"] >= 0 and not doc["extra"]["complete"]:
                pids = _rank_pids(p)
                os.kill(pids[max(pids)], signal.SIGKILL)  # the last rank (rank 1) dies mid-run
                killed = True
                break
        time.sleep(0.05)
    assert killed, "the run ended before a rank could be killed"
    log, _ = p.communicate(timeout=120)
    assert "rank 1" in log, log[-2000:]  # the launcher names the rank that failed and stops the others
    m = load_measurement(out)
    assert not m.extra["complete"] and m.last_module_idx is not None and m.last_module_idx < 2
    assert list(tmp.glob("killed.json.state.rank1of2.*"))  # every rank's state of the recorded layer is there

    _run(_measure_args(s, out), tmp)  # the same command resumes
    _same_measurement(s["single"], out)


# --------------------------------------------------------------------------
# the helpers in one process
# --------------------------------------------------------------------------
def test_split_by_cost_balances_and_is_deterministic():
    costs = [9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 2.0]
    owner = dist.split_by_cost(costs, 2)
    loads = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= 2.0 and sorted(set(owner)) == [0, 1]
    assert owner == dist.split_by_cost(costs, 2)
    assert dist.split_by_cost(costs, 1) == [0] * len(costs)


def test_split_by_cost_counts_the_ranks_work_before_the_items():
    # rank 0 already has 10 units to do (carried copies): both items go to rank 1, then balance resumes
    assert dist.split_by_cost([3.0, 3.0], 2, start=[10.0, 0.0]) == [1, 1]
    assert dist.split_by_cost([3.0, 3.0, 8.0], 2, start=[10.0, 0.0]) == [1, 0, 1]  # 8 and 3 to rank 1, then 3 to 0
    assert dist.split_by_cost([3.0, 3.0], 2) == [0, 1]


def test_carried_copies_per_rank_follow_their_owners(monkeypatch):
    from types import SimpleNamespace

    from mlx_dq.measure.run import carried_copies

    monkeypatch.setattr(dist, "size", lambda: 2)
    run = SimpleNamespace(kl_scale=True, sample_layers={0, 4, 8, 12},
                          m=SimpleNamespace(extra={"importance": {"kl_scale": {"lookups": {"embed": {}}}}}))
    assert carried_copies(run, 0) == [1, 0]  # the lookup table's copy, on rank 0
    assert carried_copies(run, 5) == [2, 1]  # + layer 0's (rank 0) and layer 4's (rank 1)
    assert carried_copies(run, 13) == [3, 2]
    assert carried_copies(SimpleNamespace(kl_scale=False), 13) == [0, 0]


def test_single_process_helpers_are_identity():
    assert dist.size() == 1 and dist.rank() == 0 and dist.is_root() and not dist.active()
    x = mx.arange(4)
    assert dist.all_sum(x) is x
    assert dist.gather_objects({"a": 1}) == [{"a": 1}]
    share = dist.RowShare(10, 4, keep=2)
    assert [share.runs(b) and share.owns(b) for b in range(3)] == [True, True, True]
    parts = [mx.full((4, 2), 1.0), mx.full((4, 2), 2.0), mx.full((2, 2), 3.0)]
    assert share.join(parts).shape == (10, 2)
    assert dist.tag("boom") == "boom"


def test_local_rows_and_merge_records():
    batches = [slice(0, 2), slice(2, 4), slice(4, 6)]
    rows = dist.LocalRows({0: mx.array([[0.0], [1.0]]), 2: mx.array([[4.0], [5.0]])}, batches)
    assert rows[4:6].tolist() == [[4.0], [5.0]]
    assert rows[:1].tolist() == [[0.0]]
    with pytest.raises(KeyError):
        rows[:3]
    opts = [QuantOption.parse(d) for d in ("1.0:2b_64g", "1.0:3b_64g", "1.0:4b_64g")]
    a, b = TensorRecord("t", (8, 64)), TensorRecord("t", (8, 64))
    a.add_option(opts[1], 0.2)
    b.add_option(opts[0], 0.4)
    b.add_option(opts[2], 0.1)
    a.extra["per"] = [2]
    b.extra["per"] = [1, 3]
    m = dist.merge_records([a, b], [o.desc for o in opts])
    assert [o.err for o in m.options] == [0.4, 0.2, 0.1] and m.extra["per"] == [1, 2, 3]
    assert all(isinstance(o, OptionRecord) for o in m.options)
    c = TensorRecord("t", (8, 64))
    c.add_option(opts[1], 0.2)
    with pytest.raises(RuntimeError):  # an option no rank measured
        dist.merge_records([c], [o.desc for o in opts])


def test_options_are_shared_by_their_measured_seconds(monkeypatch):
    """Once every option has been timed, ranks get equal measured seconds, not equal rough-model costs."""
    from types import SimpleNamespace

    import mlx.nn as nn

    from mlx_dq.measure import run as run_mod
    from mlx_dq.settings import MeasureSettings

    monkeypatch.setattr(dist, "active", lambda: True)
    monkeypatch.setattr(dist, "size", lambda: 2)
    # four group layouts: each option is a quantizer pass of its own (options of one pass go to one rank)
    opts = [QuantOption.parse(d) for d in ("1.0:2b_64g", "1.0:3b_64g", "1.0:4b_128g", "1.0:8b_32g")]
    mods = {"model.layers.1.mlp.down_proj": nn.Linear(128, 32, bias=False)}
    run = SimpleNamespace(grid_map={run_mod.role_of("model.layers.1.mlp.down_proj"): opts}, rates={},
                          s=MeasureSettings(), clip=True)
    rough = run_mod.share_options(run, mods)  # no timings yet: the rough model's equal costs, 2 and 2
    assert sorted(rough.values()) == [0, 0, 1, 1]
    # one option measured 3x slower than the others: it gets a rank to itself
    timings = {"model.layers.1.mlp.down_proj": {"1.0:2b_64g": 3.0, "1.0:3b_64g": 1.0, "1.0:4b_128g": 1.0,
                                                  "1.0:8b_32g": 1.0}}
    monkeypatch.setattr(dist, "gather_objects", lambda obj: [obj])
    run_mod.learn_rates(run, mods, timings)
    timed = run_mod.share_options(run, mods)
    slow = timed[("model.layers.1.mlp.down_proj", "1.0:2b_64g")]
    assert [r for (_, d), r in timed.items() if d != "1.0:2b_64g"] == [1 - slow] * 3


def test_options_of_one_quantizer_pass_go_to_one_rank(monkeypatch):
    """GPTQ options quantized together in one pass (one process's batches) are measured on one rank, whole: a
    pass formed from a rank's share alone would round its stacked matmuls differently from one process's."""
    from types import SimpleNamespace

    import mlx.nn as nn

    from mlx_dq.measure import run as run_mod
    from mlx_dq.quant.dispatch import option_batches
    from mlx_dq.settings import MeasureSettings

    monkeypatch.setattr(dist, "active", lambda: True)
    monkeypatch.setattr(dist, "size", lambda: 2)
    descs = ("1.0:2b_64g", "1.0:2b_32g", "1.0:3b_64g", "1.0:4b_64g", "1.0:4b_32g", "1.0:8b_64g", "1.0:8b_32g")
    opts = [QuantOption.parse(d) for d in descs]
    path = "model.layers.1.mlp.down_proj"
    mods = {path: nn.Linear(128, 32, bias=False)}
    run = SimpleNamespace(grid_map={run_mod.role_of(path): opts}, rates={}, s=MeasureSettings(), clip=True)
    passes = run_mod.layer_passes(run, mods[path], opts)  # the reference option alone: it is kept, on every row
    assert [[o.desc for o in b] for b in passes] == [["1.0:3b_64g"], ["1.0:2b_64g", "1.0:4b_64g", "1.0:8b_64g"],
                                                     ["1.0:2b_32g", "1.0:4b_32g", "1.0:8b_32g"]]
    owner = run_mod.share_options(run, mods)
    assert [d for _, d in owner] == list(descs)  # one process's option order: the merge follows it
    for batch in passes:
        assert len({owner[(path, o.desc)] for o in batch}) == 1, batch
    assert sorted(set(owner.values())) == [0, 1]
    small = option_batches(opts, (32, 128), batch_bytes=2 * 3 * 4 * 32 * 128)  # two weight copies a pass
    assert [[o.desc for o in b] for b in small] == [["1.0:2b_64g", "1.0:3b_64g"], ["1.0:2b_32g", "1.0:4b_32g"],
                                                    ["1.0:4b_64g", "1.0:8b_64g"], ["1.0:8b_32g"]]
