"""The kernels' software pipelines as compiled for Hopper (sm_90, with the ptxas Triton ships; no GPU needed): no
pipelined loop copies into a shared buffer that an unwaited async wgmma may still read (benchmarks/pipeline_check.py).

triton 3.6 gives a loaded tile that feeds both an async product and a register load one buffer too few (triton #6691);
the backward's ⟨S, dS'⟩ hit it and GDN's gradients changed from run to run on the H200 (session 25). The GPU catches
the symptom only where timing lets the copy win the race (`test_grads_repeatable`); this looks at the code itself, on
every machine. Runs in a subprocess: the check installs a stand-in sm_90 driver for the whole process.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "benchmarks", "pipeline_check.py")


def _run(tmp_path, *args, env=None):
    e = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"), **(env or {}))
    e.pop("TRITON_INTERPRET", None)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), e.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, CHECK, "--T", "256", *args], env=e, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.parametrize("shapes", ["k128", "grouped_varlen,k64,k256"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_no_product_operand_overwritten_under_async_wgmma(dtype, shapes, tmp_path):
    """Every kernel specialisation of the four families' inference forward, training forward + backward and decode, at
    K = V = 128 and at the other head layouts (grouped value heads with varlen and a carried-in state, K = V = 64,
    K = 256): no hazard."""
    p = _run(tmp_path, "--dtypes", dtype, "--shapes", shapes)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "0 with a hazard" in p.stdout


# the shape of session 24's _bwd_dqk_kernel loop (TTGIR, trimmed): S feeds the product dq (async, not waited in the
# loop) and a register load; the copy of iteration i + 2 goes to S's slot i (two buffers)
_RACY = """
    %b_S_93 = ttg.local_alloc : () -> !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> loc(#loc1)
    %b_do_92 = ttg.local_alloc : () -> !ttg.memdesc<3x64x32xbf16, #shared, #smem, mutable> loc(#loc1)
    %r:4 = scf.for %i = %c0_i32 to %c4_i32 step %c1_i32 iter_args(%acc = %cst, %s0 = %c0_i32, %s1 = %c0_i32, %t = %tok) -> (tensor<64x64xf32, #mma>, i32, i32, !ttg.async.token)  : i32 {
      %w = ttg.async_wait %t {num = 2 : i32} loc(#loc1)
      %do = ttg.memdesc_index %b_do_92[%s1] : !ttg.memdesc<3x64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc1)
      %S = ttg.memdesc_index %b_S_93[%s0] : !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc1)
      %St = ttg.memdesc_trans %S {order = array<i32: 1, 0>} : !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<32x64xbf16, #shared1, #smem, mutable> loc(#loc1)
      %Sr = ttg.local_load %S token %w : !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> -> tensor<64x32xbf16, #blocked> loc(#loc1)
      %dq = ttng.warp_group_dot %do, %St, %acc {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> * !ttg.memdesc<32x64xbf16, #shared1, #smem, mutable> -> tensor<64x64xf32, #mma> loc(#loc1)
      %S2 = ttg.memdesc_index %b_S_93[%s0] : !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc1)
      %c = ttg.async_copy_global_to_local %ptrs, %S2 mask %m other %z : tensor<64x32x!tt.ptr<bf16>, #blocked> -> <64x32xbf16, #shared, #smem, mutable> loc(#loc1)
      scf.yield %dq, %s0, %s1, %c : tensor<64x64xf32, #mma>, i32, i32, !ttg.async.token loc(#loc1)
    } loc(#loc2)
"""


def test_check_finds_the_race():
    """The check is not vacuous: the racy loop is flagged, and a wait for every product before the copy clears it."""
    sys.path.insert(0, os.path.dirname(CHECK))
    from pipeline_check import hazards
    assert hazards(_RACY) == ["copy into %b_S_93 (also register-loaded) under an unwaited product"]
    waited = _RACY.replace("      %S2 =", "      %ww:1 = ttng.warp_group_dot_wait %dq {pendings = 0 : i32} : "
                                         "tensor<64x64xf32, #mma> loc(#loc1)\n      %S2 =")
    assert hazards(waited) == []
    mma_only = _RACY.replace("ttg.local_load %S token", "ttg.other_op %S token")
    assert hazards(mma_only) == []
