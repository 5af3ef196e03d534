"""The benchmarks' harness on the CPU (torch backend, tiny shapes; no GPU, no fla): the shape registry, each
benchmark's JSON / plot / table, the agreement check against a peer, the context-parallel benchmark under torchrun
(two gloo processes), the handling of fla's autotuning and of its Hopper guard (on stand-in modules), and the sweep
driver's plan product."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import types

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import bench_cp  # noqa: E402
import bench_cpu  # noqa: E402
import bench_decode  # noqa: E402
import bench_forward  # noqa: E402
import bench_train  # noqa: E402
import common  # noqa: E402
import shapes  # noqa: E402
import sweep  # noqa: E402

import chunkwise  # noqa: E402
from helpers import DEVICE  # noqa: E402

SMOKE = "B1-T130-H2-HV4-K32"


# -- the shape registry ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_shape_name_reads_its_fields(name):
    s = shapes.SHAPES[name]
    assert f"-T{s.T}-H{s.H}" in name and (f"-HV{s.HV}" in name) == (s.HV != s.H)
    assert (f"-K{s.K}" in name) == (s.K != 128)
    assert name.startswith(f"B{s.B}-") or s.cu_seqlens is not None
    if s.cu_seqlens is not None:
        assert s.B == 1 and s.cu_seqlens[0] == 0 and s.cu_seqlens[-1] == s.T
        assert all(b > a for a, b in zip(s.cu_seqlens, s.cu_seqlens[1:]))


def test_sets_name_registered_shapes_and_resolve_keeps_order_once():
    for names in shapes.SETS.values():
        assert all(n in shapes.SHAPES for n in names)
    got = [s.name for s in shapes.resolve("B8-T4096-H32,standing,few-heads")]
    assert got[0] == "B8-T4096-H32" and len(got) == len(set(got))
    assert set(got) == set(shapes.SETS["standing"]) | set(shapes.SETS["few-heads"])
    assert shapes.SHAPES["varlen16-T32768-H32"].sequences == 16
    with pytest.raises(SystemExit, match="unknown shape"):
        shapes.resolve("standing,B3-nothing")


@pytest.mark.parametrize("op", common.OPS)
@pytest.mark.parametrize("name", shapes.SETS["smoke"])
def test_make_inputs_shapes(op, name):
    s = shapes.SHAPES[name]
    x = shapes.make_inputs(op, s, torch.bfloat16, "cpu")
    assert x["q"].shape == (s.B, s.T, s.H, s.K) and x["v"].shape == (s.B, s.T, s.HV, s.V)
    assert x["q"].dtype == torch.bfloat16
    assert (x["g"] is None) == (op == "delta") and (x["beta"] is None) == (op == "gla")
    if x["g"] is not None:
        assert x["g"].dtype == torch.float32 and x["g"].shape[-1] == (s.K if op == "kda" else s.HV)
        assert bool((x["g"] <= 0).all())
    assert torch.allclose(x["k"].float().norm(dim=-1), torch.ones(()), atol=1e-2)
    if s.cu_seqlens is not None:
        assert x["cu_seqlens_cpu"].tolist() == list(s.cu_seqlens)
        assert torch.equal(x["chunk_indices"], chunkwise.prepare_chunk_indices(x["cu_seqlens_cpu"]))


# -- each benchmark: JSON, plot, table last, exit status ---------------------------------------------------------

def _run(main, argv, tmp_path, capsys):
    rc = main(argv + ["--out", str(tmp_path), "--commit", "abc123"])
    out = capsys.readouterr().out
    return rc, out


@pytest.mark.parametrize("bench, argv, json_name, cols, time_key", [
    (bench_forward, ["--shapes", f"{SMOKE},varlen3-T130-H2-HV4-K32", "--ops", "gdn"], "bench_forward.json",
     bench_forward.COLUMNS, "ms"),
    (bench_train, ["--shapes", SMOKE, "--ops", "gla"], "bench_train.json", bench_train.COLUMNS, "ms"),
    (bench_decode, ["--shapes", "B2-T1-H2-HV4-K32", "--ops", "kda"], "bench_decode.json", bench_decode.COLUMNS, "us"),
    (bench_cpu, ["--shapes", SMOKE, "--ops", "delta", "--reps", "1"], "bench_cpu.json", bench_cpu.COLUMNS, "ms"),
], ids=["forward", "train", "decode", "cpu"])
def test_benchmark_writes_json_plot_and_table(bench, argv, json_name, cols, time_key, tmp_path, capsys):
    rc, out = _run(bench.main, argv + ["--device", "cpu", "--dtype", "fp32", "--no-peers"], tmp_path, capsys)
    assert rc == 0
    data = json.load(open(tmp_path / json_name))
    meta, rows = data["meta"], data["rows"]
    for key in ("device", "torch", "triton", "fla", "commit", "date", "dtype", "benchmark"):
        assert key in meta
    assert meta["commit"] == "abc123" and meta["fla"] is None
    assert rows and all(r["ok"] for r in rows)
    assert all(r[time_key] > 0 for r in rows)                     # every row timed
    assert os.path.getsize(tmp_path / json_name.replace(".json", ".png")) > 1000
    table = out.rstrip().splitlines()[-(len(rows) + 2):]           # the markdown table is printed last
    assert table[0] == "| " + " | ".join(h for h, _, _ in cols) + " |"
    assert table[1].startswith("|---") and all(line.startswith("| ") for line in table[2:])


def test_bench_cp_under_torchrun_with_two_gloo_ranks(tmp_path):
    """bench_cp.py as the GPU runs launch it, on two CPU processes: each row's split run equals the whole run, every
    phase timed on both ranks, a shape too short to split skipped, and rank 0 alone writes the JSON, plot and table."""
    import subprocess
    root = os.path.dirname(BENCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")]))
    argv = ["--device", "cpu", "--dtype", "fp32", "--ops", "delta,gla", "--reps", "1", "--out", str(tmp_path),
            "--shapes", f"{SMOKE},varlen3-T130-H2-HV4-K32,B2-T1-H2-HV4-K32", "--commit", "abc123"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        os.path.join(BENCH, "bench_cp.py"), *argv], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.load(open(tmp_path / "bench_cp_w2.json"))
    meta, rows = data["meta"], data["rows"]
    assert meta["world_size"] == 2 and meta["process_group"] == "gloo" and meta["commit"] == "abc123"
    assert [(r["shape"], r["op"]) for r in rows] == [(s, op) for s in (SMOKE, "varlen3-T130-H2-HV4-K32")
                                                      for op in ("delta", "gla")]
    assert "B2-T1-H2-HV4-K32 skipped: 1 tokens cannot be split over 2 ranks" in p.stderr
    for r in rows:
        assert r["ok"] and r["max_err"] < 1e-5 and {"err_o", "err_dq", "err_dv", "err_final_state"} <= set(r)
        times = {k: v for k, v in r.items() if k.endswith("_ranks")}
        assert len(times) == 9 and all(len(v) == 2 and min(v) >= 0 for v in times.values())
        assert r["carry_fwd_ranks"][1] > 0 and r["cp_ms"] == max(r["cp_ranks"]) and r["x"] > 0
    assert os.path.getsize(tmp_path / "bench_cp_w2.png") > 1000
    header = "| " + " | ".join(h for h, _, _ in bench_cp.COLUMNS) + " |"
    lines = p.stdout.rstrip().splitlines()
    assert lines.count(header) == 1 and lines[-(len(rows) + 2)] == header   # once (rank 0), last


def _fake_fla_gdn(shift):
    """A stand-in for fla's chunk_gated_delta_rule: chunkwise's torch backend, its output shifted by ``shift``."""
    def fn(q, k, v, g, beta, output_final_state=True, **kw):
        o, ht = chunkwise.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, backend="torch")
        return o + shift, ht
    return fn


@pytest.mark.parametrize("shift, rc", [(0.0, 0), (1.0, 1)], ids=["agree", "disagree"])
def test_forward_checks_outputs_against_peer(shift, rc, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common, "fla_op", lambda op, mode="chunk": _fake_fla_gdn(shift))
    monkeypatch.setattr(common, "fla_fresh_search", lambda: None)
    got, _ = _run(bench_forward.main, ["--shapes", SMOKE, "--ops", "gdn", "--dtype", "fp32", "--device", "cpu"],
                  tmp_path, capsys)
    row = json.load(open(tmp_path / "bench_forward.json"))["rows"][0]
    assert got == rc and row["ok"] == (rc == 0) and row["fla_ms"] > 0
    assert (row["o_vs_fla"] < 1e-5) == (shift == 0.0) and row["state_vs_fla"] < 1e-5


@pytest.mark.parametrize("bench", [bench_forward, bench_train], ids=["forward", "train"])
def test_gate_scale_draws_the_gates_it_names(bench, tmp_path, capsys, monkeypatch):
    """--gate-scale S: the gates are S·logsigmoid(randn) (the same draw scaled), and the JSON records S."""
    drawn = []

    def spy(*a, **kw):
        x = shapes.make_inputs(*a, **kw)
        drawn.append(x["g"])
        return x
    monkeypatch.setattr(bench, "make_inputs", spy)
    for scale in (0.1, 4.0):
        rc, _ = _run(bench.main, ["--shapes", SMOKE, "--ops", "kda", "--dtype", "fp32", "--device", "cpu", "--no-peers",
                                  "--gate-scale", str(scale)], tmp_path, capsys)
        meta = json.load(open(tmp_path / f"{bench.__name__}.json"))["meta"]
        assert rc == 0 and meta["gate_scale"] == scale
    assert drawn[1].min() < -3 and torch.allclose(drawn[1], drawn[0] * 40)


def test_collect_keeps_the_rows_before_an_interrupt(capsys):
    """gpu_run.sh ends a phase at its limit with SIGINT: the rows timed so far are kept (and printed as they came)."""
    def stop():
        raise KeyboardInterrupt
    seen = []
    rows, cut = common.collect([lambda: dict(a=1), lambda: dict(a=2), stop, lambda: dict(a=3)], "cpu",
                               on_row=lambda rows: seen.append(len(rows)))
    assert rows == [dict(a=1), dict(a=2)] and cut and seen == [1, 2]
    assert capsys.readouterr().out.splitlines() == ['{"a": 1}', '{"a": 2}']
    assert common.collect([lambda: dict(a=1)], "cpu") == ([dict(a=1)], False)
    assert common.collect([lambda: dict(a=1)], "cpu", time_limit=0) == ([], True)       # no row starts past it


def test_gpu_run_refuses_unknown_phases(tmp_path):
    import subprocess
    p = subprocess.run(["bash", os.path.join(BENCH, "gpu_run.sh"), "forwrad"], capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert p.returncode == 2 and "unknown argument forwrad" in p.stderr and not os.listdir(tmp_path)


def test_markdown_table_marks_missing_values():
    t = common.markdown_table([dict(a=1.23456, b=None)], [("A", "a", ".2f"), ("B", "b", ".1f"), ("C", "c", "")])
    assert t.splitlines() == ["| A | B | C |", "|---|---|---|", "| 1.23 | - | - |"]


# -- fla's autotuning and its Hopper guard, on stand-in modules ---------------------------------------------------

def _tuned(wrap: bool):
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    @triton.jit
    def kernel(x, N: tl.constexpr):
        pass

    configs = [triton.Config({}, num_warps=w) for w in (2, 4)]
    at = triton.autotune(configs=configs, key=["N"])(kernel)
    assert isinstance(at, Autotuner)
    at.cache_results = True                     # as fla builds them with FLA_CACHE_RESULTS on
    at.cache[(64,)] = configs[1]                # a pick from earlier in the process (or read from disk)
    outer = triton.heuristics({"N": lambda args: 64})(at) if wrap else at
    return at, outer


def test_fla_picks_are_recorded_then_forgotten(monkeypatch):
    """fla_fresh_search reaches every autotuner fla has loaded, also behind triton.heuristics, and only those."""
    (direct, direct_outer), (wrapped, wrapped_outer), (other, other_outer) = _tuned(False), _tuned(True), _tuned(False)
    fla_mod = types.ModuleType("fla.ops.stand_in")
    fla_mod.direct, fla_mod.wrapped = direct_outer, wrapped_outer
    other_mod = types.ModuleType("not_fla.ops")
    other_mod.kernel = other_outer
    monkeypatch.setitem(sys.modules, "fla.ops.stand_in", fla_mod)
    monkeypatch.setitem(sys.modules, "not_fla.ops", other_mod)
    assert common.fla_autotune_picks()["kernel"] == {"(64,)": str(direct.configs[1])}
    assert {id(a) for a in common._fla_autotuners()} >= {id(direct), id(wrapped)}
    assert other not in common._fla_autotuners()
    common.fla_fresh_search()
    for at in (direct, wrapped):
        assert at.cache_results is False and at.cache == {}
        assert at.do_bench.keywords == dict(warmup=common.FLA_SEARCH_MS[0], rep=common.FLA_SEARCH_MS[1])
    assert other.cache_results is True and other.cache      # not fla's: untouched
    monkeypatch.setattr(common, "COMPILE_ONLY", True)       # --warmup: each candidate compiled and run once
    common.fla_fresh_search()
    calls = []
    assert direct.do_bench(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8)) == [1.0] * 3 and calls == [1]
    assert "kernel" not in common.fla_autotune_picks()


@pytest.mark.parametrize("hopper, above", [(True, False), (True, True), (False, False)])
def test_fla_hopper_guard_lifted_only_where_it_stands(hopper, above, monkeypatch):
    mods = {n: types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.common", "fla.ops.common.chunk_o")}
    mods["fla"].ops, mods["fla.ops"].common, mods["fla.ops.common"].chunk_o = (
        mods["fla.ops"], mods["fla.ops.common"], mods["fla.ops.common.chunk_o"])
    chunk_o = mods["fla.ops.common.chunk_o"]
    chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_7_1 = hopper, above
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    with bench_train.fla_hopper_guard_lifted() as lifted:
        assert lifted == (hopper and not above)
        assert chunk_o.TRITON_ABOVE_3_7_1 is (above or lifted)
    assert chunk_o.TRITON_ABOVE_3_7_1 is above


# -- the sweep driver ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    bv: int = 64
    num_warps: int = 4
    tma: bool = True
    form: str = "t"
    full: frozenset = frozenset()
    caps: dict = dataclasses.field(default_factory=dict)      # a plan need not hash


def test_sweep_builds_the_cartesian_product_over_the_default():
    sets = sweep.parse_sets(_Plan, ["bv=32,64", "num_warps=4,8", "tma=false"])
    assert sets == {"bv": [32, 64], "num_warps": [4, 8], "tma": [False]}
    plans = sweep.product(_Plan(form="w"), sets)
    assert len(plans) == 4 and len(sweep._unique(plans)) == 4
    assert {(p.bv, p.num_warps) for p in plans} == {(32, 4), (32, 8), (64, 4), (64, 8)}
    assert all(p.tma is False and p.form == "w" for p in plans)   # fields not swept keep the default's value
    assert sweep.product(_Plan(), {}) == [_Plan()]


def test_sweep_names_unknown_fields_and_bad_values():
    with pytest.raises(SystemExit, match="bv, num_warps, tma, form, full, caps"):
        sweep.parse_sets(_Plan, ["warps=4"])
    with pytest.raises(SystemExit, match="num_warps"):
        sweep.parse_sets(_Plan, ["num_warps=four"])
    assert sweep.parse_sets(_Plan, ["form=t,w"]) == {"form": ["t", "w"]}
    sets = sweep.parse_sets(_Plan, ['full={"fwd_h", "bwd_dh"},{}', 'caps={"wu": 168},{}'])
    assert sets == {"full": [frozenset({"fwd_h", "bwd_dh"}), frozenset()], "caps": [{"wu": 168}, {}]}
    plans = sweep._unique([_Plan(), *sweep.product(_Plan(), sets)])
    assert len(plans) == 4 and plans[0] == _Plan()


@pytest.mark.parametrize("stage, dtype", [("fwd", "fp32"), ("bwd", "bf16")])   # (the backward runs fp32 planless)
def test_sweep_times_each_plan_through_the_launcher(stage, dtype, tmp_path, capsys):
    """On the library's own plans (the interpreter, one decode-sized shape): the default plan and a variant timed
    with the same outputs, and a plan the kernels cannot build reported in its row, not raised."""
    rc = sweep.main(["--stage", stage, "--device", str(DEVICE), "--dtype", dtype, "--ops", "gla", "--shapes",
                     "B2-T1-H2-HV4-K32", "--set", "bv=16,24", "--out", str(tmp_path), "--commit", "abc123"])
    rows = json.load(open(tmp_path / f"sweep_{stage}.json"))["rows"]
    assert rc == 0 and [r["plan"]["bv"] for r in rows][1:] == [16, 24] and [r["default"] for r in rows] == [1, 0, 0]
    assert all(r["ms"] > 0 for r in rows[:2])
    # replayed from a CUDA graph on a GPU; no such timing on the CPU
    assert all(r["graph_ms"] is None if DEVICE == "cpu" else r["graph_ms"] > 0 for r in rows[:2])
    if stage == "fwd":          # (the interpreter's 16-bit backward is no reference: its values go unchecked here)
        assert rows[1]["vs_default"] < 1e-6
    assert "bv = 24: block sizes must be powers of 2" in rows[2]["error"] and "ms" not in rows[2]
    assert "* {'bv': " in capsys.readouterr().out
