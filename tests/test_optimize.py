"""Optimizer: budget, optimality against brute force, bounds, keep rules, constraints, plan files."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import baselines
import numpy as np
import pytest
from seeds import seed_path  # noqa: E402

from mlx_dq.measure.records import (
    JointGroup,
    JointOption,
    Measurement,
    OptionRecord,
    TensorRecord,
    load_measurement,
)
from mlx_dq.plan.plan import load_plan, plan_to_mlx_config, save_plan
from mlx_dq.plan.solver import SolverEffort, optimize
from mlx_dq.quant.options import QuantOption

UNIFORM = [QuantOption.uniform(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
MIXED = [QuantOption.parse(d) for d in ("0.1:4b_32g/0.9:3b_32g", "0.25:6b_64g/0.75:4b_64g", "0.5:3b_128g/0.5:2b_128g")]


def _record(opt: QuantOption, bits: int, numel: int, err: float) -> OptionRecord:
    return OptionRecord(opt, bits / numel, bits, err)


def _random(rng: np.random.Generator, n: int, k: int, mixed: bool = True) -> Measurement:
    """Random tensors whose options carry test-chosen bits and errors (no real quantization)."""
    m = Measurement()
    pool = UNIFORM + (MIXED if mixed else [])
    for i in range(n):
        shape = (64, int(rng.choice([64, 128, 256])))
        t = TensorRecord(f"model.layers.{i}.mlp.down_proj", shape, importance=float(rng.uniform(0.2, 3)))
        for j in sorted(rng.choice(len(pool), k, replace=False)):
            bits = int(rng.integers(2, 40) * t.numel // 4 + rng.integers(0, 999))
            t.options.append(_record(pool[j], bits, t.numel, float(rng.uniform(1e-3, 0.3))))
        m.tensors[t.key] = t
    return m


def _brute(m: Measurement, budget: int) -> float | None:
    """Least sum of importance * err^2 over all combinations within budget."""
    ts = list(m.tensors.values())
    best = None
    for combo in itertools.product(*[t.options for t in ts]):
        if sum(o.total_bits for o in combo) <= budget:
            d = sum(t.importance * o.err ** 2 for t, o in zip(ts, combo))
            best = d if best is None else min(best, d)
    return best


def _range(m: Measurement) -> tuple[int, int, int]:
    ts = list(m.tensors.values())
    return (sum(min(o.total_bits for o in t.options) for t in ts),
            sum(max(o.total_bits for o in t.options) for t in ts),
            sum(t.numel for t in ts))


def test_budget_never_exceeded() -> None:
    rng = np.random.default_rng(1)
    for _ in range(25):
        m = _random(rng, int(rng.integers(5, 40)), int(rng.integers(2, 8)))
        lo, hi, n = _range(m)
        for target in np.linspace(lo / n, hi / n, 9):
            plan = optimize(m, float(target))
            assert plan.budget_bits == math.floor(float(target) * n + 1e-6)
            used = sum(e.bits for e in plan.tensors)
            assert used == plan.used_bits <= plan.budget_bits
            assert plan.achieved_bpw <= target + 1e-12
            assert plan.lower_bound is not None and plan.gap is not None
            assert plan.gap >= 0 and plan.lower_bound <= plan.objective + 1e-12


def test_exact_on_tiny_instances_and_bound_is_valid() -> None:
    rng = np.random.default_rng(2)
    for _ in range(150):
        m = _random(rng, int(rng.integers(2, 5)), int(rng.integers(2, 5)))
        lo, hi, n = _range(m)
        target = float(rng.uniform(lo, hi)) / n
        best = _brute(m, math.floor(target * n))
        plan = optimize(m, target)
        assert plan.objective == pytest.approx(best, rel=1e-12, abs=1e-15)
        heuristic = optimize(m, target, effort=SolverEffort(exact_states=0))  # the Lagrangian + exchange path alone
        assert heuristic.lower_bound <= best * (1 + 1e-12) + 1e-15
        assert heuristic.objective >= best * (1 - 1e-12)
        assert heuristic.used_bits <= math.floor(target * n)


def test_heuristic_gap_is_small_on_many_tensors() -> None:
    m = _random(np.random.default_rng(3), 200, 10)
    lo, hi, n = _range(m)
    plan = optimize(m, (0.6 * lo + 0.4 * hi) / n, effort=SolverEffort(exact_states=0))
    assert plan.gap <= 0.01 * plan.objective
    assert plan.achieved_bpw >= plan.target_bpw - 0.02


def test_impossible_targets_name_the_range() -> None:
    m = _random(np.random.default_rng(4), 6, 4)
    lo, hi, n = _range(m)
    for target in (0.5 * lo / n, 1.5 * hi / n):
        with pytest.raises(ValueError) as e:
            optimize(m, target)
        assert f"{lo / n:.4f}" in str(e.value) and f"{hi / n:.4f}" in str(e.value)
    with pytest.raises(ValueError, match="positive"):
        optimize(m, -1.0)


def test_mlx_lm_compatible_uses_whole_tensor_options_only() -> None:
    rng = np.random.default_rng(5)
    m = _random(rng, 30, 8)
    for t in m.tensors.values():  # every tensor keeps at least one whole-tensor option
        t.options.append(_record(QuantOption.uniform(8, 32), 12 * t.numel, t.numel, 1e-4))
    lo, hi, n = _range(m)
    free = optimize(m, (lo + hi) / 2 / n)
    plan = optimize(m, (lo + hi) / 2 / n, mlx_lm_compatible=True)
    assert any(QuantOption.parse(e.option).is_mixed for e in free.tensors)
    assert not any(QuantOption.parse(e.option).is_mixed for e in plan.tensors)
    assert plan.objective >= free.objective * (1 - 1e-12)


def test_mlx_lm_compatible_without_whole_options_fails_clearly() -> None:
    m = Measurement()
    t = TensorRecord("model.layers.0.mlp.up_proj", (64, 128))
    t.options.append(_record(MIXED[0], 3 * t.numel, t.numel, 0.1))
    m.tensors[t.key] = t
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj"):
        optimize(m, 4.0, mlx_lm_compatible=True)


def _seed003_like(seed_cfg: dict | None) -> tuple[Measurement, set[str], dict]:
    """A non-LLM measurement with parts named like seed 003.

    layers.* (backbone), groups.N.M.x / heads.* / in_proj (depth), table (neither).
    """
    if seed_cfg is not None:
        names = {k[: -len(".weight")]: tuple(v["shape"]) for k, v in seed_cfg["tensors"].items()}
        names.update({k[: -len(".weight")]: (64, 64) for k in seed_cfg["kept_16bit"]})
    else:
        names = {"embed_tokens": (512, 64), "table": (256, 64), "in_proj": (64, 128)}
        for i in range(6):
            for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                names[f"layers.{i}.{p}"] = (64, 64)
        for g in range(3):
            for j in range(2):
                for p in ("qkv", "o", "f1", "f2"):
                    names[f"groups.{g}.{j}.{p}"] = (64, 64)
        for h in range(5):
            names[f"heads.{h}"] = (64, 64)
    sensitive = {"layers.2.mlp.down_proj", "layers.27.mlp.down_proj"} if seed_cfg else {
        "layers.2.mlp.down_proj", "layers.4.mlp.down_proj"}
    m = Measurement()
    rng = np.random.default_rng(6)
    for key, shape in names.items():
        t = TensorRecord(key, shape, role="other")
        scale = 10.0 if key in sensitive else 1.0
        for opt, err in ((QuantOption.uniform(4, 64), 0.05), (QuantOption.uniform(8, 32), 0.004)):
            t.options.append(_record(opt, opt.storage_bits(shape), t.numel, scale * err * rng.uniform(0.8, 1.0)))
        m.tensors[key] = t
    depth = {k for k in names if k.startswith(("groups.", "heads.", "in_proj"))}
    parts = {"backbone": ["layers.*", "embed_tokens"], "depth": ["groups.*", "heads.*", "in_proj"]}
    return m, depth | sensitive, parts


@pytest.mark.parametrize("use_seed", [False, True])
def test_keep_most_sensitive_reproduces_seed003_semantics(use_seed: bool) -> None:
    cfg = None
    if use_seed:
        cfg = json.loads(seed_path("003").read_text())
    m, expected_kept, parts = _seed003_like(cfg)
    keep = {"backbone": 2, "depth": 999}
    ts = m.tensors.values()
    lo = sum(16 * t.numel if t.key in expected_kept else min(o.total_bits for o in t.options) for t in ts)
    hi = sum(16 * t.numel if t.key in expected_kept else max(o.total_bits for o in t.options) for t in ts)
    plan = optimize(m, (lo + hi) / 2 / m.numel(), head_option=None, keep_most_sensitive=keep, parts=parts)
    assert set(plan.kept) == expected_kept
    out = plan_to_mlx_config(plan)
    assert out["mode"] == "affine" and out["scan"]["keep_backbone"] == 2 and out["scan"]["keep_depth"] == 999
    assert set(out["kept_16bit"]) == {k + ".weight" for k in expected_kept}
    assert set(out["tensors"]) == {k + ".weight" for k in m.tensors if k not in expected_kept}
    for name, entry in out["tensors"].items():
        assert entry["shape"] == list(m.tensors[name[: -len(".weight")]].shape)
        assert entry["bits"] in (4, 8)
    if cfg is not None:
        assert sorted(out["kept_16bit"]) == sorted(cfg["kept_16bit"])
        assert set(out["tensors"]) == set(cfg["tensors"])
    # kept tensors count 16 bits per weight inside the budget
    kept_bits = sum(e.bits for e in plan.tensors if e.scope == "kept")
    assert kept_bits == 16 * sum(m.tensors[k].numel for k in expected_kept)
    assert plan.used_bits <= plan.budget_bits


def test_explicit_keep_patterns_and_head_scope() -> None:
    m = _random(np.random.default_rng(7), 8, 5)
    emb = TensorRecord("model.embed_tokens", (1024, 64), role="embed_head")
    emb.options.append(_record(QuantOption.uniform(6, 64), QuantOption.uniform(6, 64).storage_bits((1024, 64)),
                               emb.numel, 0.01))
    m.tensors[emb.key] = emb
    m.tied = {"lm_head": "model.embed_tokens"}
    lo, hi, n = _range(m)
    n_dec = n - emb.numel
    plan = optimize(m, 9.0, keep=["model.layers.3.*"], head_option="1.0:6b_64g")
    head = plan.entry("model.embed_tokens")
    assert head.scope == "head" and head.option == "1.0:6b_64g" and head.err == 0.01
    assert plan.numel == n_dec  # the head is outside the budget
    assert plan.entry("model.layers.3.mlp.down_proj").option == "16bit"
    assert plan.kept == ["model.layers.3.mlp.down_proj"]
    with pytest.raises(ValueError, match="mixed"):
        optimize(m, 9.0, head_option="0.1:4b_32g/0.9:3b_32g", mlx_lm_compatible=True)
    with pytest.raises(ValueError, match="no_such"):
        optimize(m, 9.0, keep=["no_such.*"])


def _joint(rng: np.random.Generator) -> Measurement:
    m = Measurement()
    for layer in range(3):
        key = f"model.layers.{layer}.mlp"
        members = [f"{key}.gate_proj", f"{key}.up_proj"]
        g = JointGroup(key, members)
        for k in members:
            m.tensors[k] = TensorRecord(k, (64, 128), group=key)
        for opt in (UNIFORM[0], UNIFORM[5], MIXED[0], UNIFORM[10]):
            recs = {k: _record(opt, opt.storage_bits((64, 128)), 64 * 128, None) for k in members}
            g.options.append(JointOption(recs, sum(r.total_bits for r in recs.values()), float(rng.uniform(0, 0.2))))
        m.groups[key] = g
    return m


def test_joint_groups_are_one_item() -> None:
    m = _joint(np.random.default_rng(8))
    n = m.numel()
    budgets = [sum(o.total_bits for o in combo) for combo in itertools.product(*[g.options for g in m.groups.values()])]
    for target in np.linspace(min(budgets) / n, max(budgets) / n, 7):
        plan = optimize(m, float(target))
        best = min(sum(o.err ** 2 for o in combo)
                   for combo in itertools.product(*[g.options for g in m.groups.values()])
                   if sum(o.total_bits for o in combo) <= math.floor(target * n))
        assert plan.objective == pytest.approx(best)
        for g in m.groups.values():  # members of a module move together
            assert len({plan.entry(k).option for k in g.members}) == 1


def test_plan_json_round_trip(tmp_path: Path) -> None:
    m = _random(np.random.default_rng(9), 12, 6)
    lo, hi, n = _range(m)
    plan = optimize(m, (lo + hi) / 2 / n, keep=["model.layers.0.*"])
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert load_plan(path) == plan
    doc = json.loads(path.read_text())
    assert doc["format"] == "mlx_dq.plan" and {"objective", "lower_bound", "gap", "tensors"} <= set(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "tensors": [{"key": "x"}]}))
    with pytest.raises(ValueError, match="malformed"):
        load_plan(bad)
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not an"):
        load_plan(bad)


def test_seed_plans_meet_targets() -> None:
    m = load_measurement(seed_path("000"))
    for target in (2.5, 4.0):
        plan = optimize(m, target)
        assert target - 0.02 <= plan.achieved_bpw <= target
        assert plan.objective <= baselines.greedy_single_pass(m, target).objective


def test_measured_damage_overrides_importance_times_err() -> None:
    """An option with a directly measured damage (the head's KL) is priced by it, not by importance * err**2."""
    m = _random(np.random.default_rng(11), 3, 4, mixed=False)
    head = TensorRecord("lm_head", (1024, 64), role="embed_head", importance=1.0)
    cheap, dear = QuantOption.uniform(2, 64), QuantOption.uniform(8, 64)
    for opt, err in ((cheap, 0.3), (dear, 0.01)):
        head.options.append(_record(opt, opt.storage_bits(head.shape), head.numel, err))
    m.tensors[head.key] = head
    lo, hi, n = _range(m)
    head_diff = head.options[1].total_bits - head.options[0].total_bits
    target = (lo + head_diff + 0.5 * (hi - lo - head_diff)) / n  # the dear head fits, with room for the layers
    assert optimize(m, target, head_option=None).entry("lm_head").scope == "budget"
    # with err**2 pricing the cheap head costs 0.09; say instead that it really costs 100 nats
    head.options[0].damage, head.options[1].damage = 100.0, 0.0
    assert optimize(m, target, head_option=None).entry("lm_head").option == dear.desc
    head.options[0].damage, head.options[1].damage = 0.0, 0.0  # and free: the budget goes to the layers
    assert optimize(m, target, head_option=None).entry("lm_head").option == cheap.desc


def test_embedding_and_head_damage_counts_at_the_head_weight() -> None:
    """Measured head damage counts ``head_damage_weight`` of the decoder's: at 1.0 the dear head is worth its bits,
    at the default 0.5 they go to the layers; the objective is the weighted sum; the decoder alone is unaffected."""
    from mlx_dq.errors import InputError
    from mlx_dq.plan.solver import HEAD_DAMAGE_WEIGHT, option_damage

    m = Measurement()
    layer = TensorRecord("model.layers.0.mlp.down_proj", (64, 1024), importance=1.0)
    head = TensorRecord("lm_head", (64, 1024), role="embed_head", importance=1.0)
    lo_opt, hi_opt = QuantOption.uniform(2, 64), QuantOption.uniform(4, 64)
    for t, dmg in ((layer, (1.0, 0.0)), (head, (1.5, 0.0))):  # the head's step is worth 1.5, the layer's 1.0
        for opt, d in zip((lo_opt, hi_opt), dmg):
            t.options.append(_record(opt, opt.storage_bits(t.shape), t.numel, 0.1))
            t.options[-1].damage = d
        m.tensors[t.key] = t
    target = (lo_opt.storage_bits(layer.shape) + hi_opt.storage_bits(layer.shape)) / 2 / layer.numel  # one step
    whole = optimize(m, target, head_option=None, head_damage_weight=1.0)
    assert whole.entry("lm_head").option == hi_opt.desc and whole.objective == pytest.approx(1.0)
    assert HEAD_DAMAGE_WEIGHT == 0.5
    half = optimize(m, target, head_option=None)
    assert half.settings["head_damage_weight"] == 0.5
    assert half.entry("lm_head").option == lo_opt.desc and half.entry(layer.key).option == hi_opt.desc
    assert half.objective == pytest.approx(0.5 * 1.5)
    assert option_damage(0.1, 1.0, 1.5) == 1.5  # the recorded damage itself is not changed
    dec = _random(np.random.default_rng(5), 6, 4)
    lo, hi, n = _range(dec)
    assert [e.option for e in optimize(dec, (lo + hi) / 2 / n, head_damage_weight=0.1).tensors] == \
        [e.option for e in optimize(dec, (lo + hi) / 2 / n, head_damage_weight=1.0).tensors]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(InputError, match="head damage weight"):
            optimize(m, target, head_option=None, head_damage_weight=bad)


def test_joint_members_are_ordered_by_damage_at_the_plans_error_power() -> None:
    """A joint member's own damage (the keep rule's tie order) uses the optimizer's ``err_power``, not 2."""
    from types import SimpleNamespace

    from mlx_dq.plan.solver import _member_sensitivity

    rec = SimpleNamespace(importance=3.0, options=[SimpleNamespace(err=0.5, damage=None, bpw=3.5),
                                                   SimpleNamespace(err=0.1, damage=None, bpw=5.5)])
    it = SimpleNamespace(members={"a": 1, "b": 1})
    m = SimpleNamespace(tensors={"a": rec})
    assert _member_sensitivity(it, "a", m, 3.5, 1.0) == pytest.approx(3.0 * 0.5)
    assert _member_sensitivity(it, "a", m, 3.5, 2.0) == pytest.approx(3.0 * 0.25)
    assert _member_sensitivity(it, "a", m, 5.4, 3.0) == pytest.approx(3.0 * 0.1**3)


def test_build_problem_takes_keep_outside_budget_as_optimize_does() -> None:
    """The planning baselines build their problem with optimize's keywords; a kept tensor outside the budget must
    leave the budget as optimize leaves it (it was refused with a TypeError before)."""
    from mlx_dq.plan.solver import build_problem

    m = _random(np.random.default_rng(5), 6, 4)
    kept = "model.layers.0.mlp.down_proj"
    lo, hi, n = _range(m)
    target = (lo + hi) / 2 / n
    inside = build_problem(m, target, keep=[kept])
    outside = build_problem(m, target, keep=[kept], keep_outside_budget=True)
    plan = optimize(m, target, keep=[kept], keep_outside_budget=True)
    assert outside.settings["keep_outside_budget"] is True and inside.settings["keep_outside_budget"] is False
    assert outside.budget == plan.budget_bits
    assert outside.numel == inside.numel - m.tensors[kept].numel
    with pytest.raises(TypeError, match="unexpected"):
        build_problem(m, target, no_such_option=1)
