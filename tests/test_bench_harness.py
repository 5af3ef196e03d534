"""The benchmarks' handling of fla's autotuning (benchmarks/bench_forward.py), on stand-in modules: no fla, no GPU.

fla 0.6.0's autotuners read Triton's kept results from disk whenever its FLA_CACHE_RESULTS is on (the default), and
some of their keys leave T out, so a timing of fla could run with a pick made in another run or at another shape:
on the H200 fla's GDN forward at B1-T32768-H32 took 2.12 ms with the picks kept from one run against 1.93 ms after a
fresh search (benchmarks/NOTES.md, session 30). fla_fresh_search must reach every autotuner fla has loaded, also
behind triton.heuristics, and only those."""
from __future__ import annotations

import os
import sys
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_forward  # noqa: E402


def _tuned(wrap: bool):
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


@pytest.fixture
def stand_ins(monkeypatch):
    direct, direct_outer = _tuned(wrap=False)
    wrapped, wrapped_outer = _tuned(wrap=True)
    other, other_outer = _tuned(wrap=False)
    fla_mod = types.ModuleType("fla.ops.stand_in")
    fla_mod.direct, fla_mod.wrapped = direct_outer, wrapped_outer
    other_mod = types.ModuleType("not_fla.ops")
    other_mod.kernel = other_outer
    monkeypatch.setitem(sys.modules, "fla.ops.stand_in", fla_mod)
    monkeypatch.setitem(sys.modules, "not_fla.ops", other_mod)
    return direct, wrapped, other


def test_fla_picks_are_recorded_then_forgotten(stand_ins):
    direct, wrapped, other = stand_ins
    picks = bench_forward.fla_autotune_picks()
    assert picks["kernel"] == {"(64,)": str(direct.configs[1])}
    assert len([a for a in bench_forward._fla_autotuners() if a in (direct, wrapped)]) == 2
    assert other not in bench_forward._fla_autotuners()
    bench_forward.fla_fresh_search()
    for at in (direct, wrapped):
        assert at.cache_results is False and at.cache == {}
    assert other.cache_results is True and other.cache      # not fla's: untouched
    assert "kernel" not in bench_forward.fla_autotune_picks()
