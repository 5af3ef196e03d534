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


def _env(tmp_path, env=None):
    """A compiling subprocess's environment: its own Triton cache, no interpreter, the package on the path."""
    e = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"), **(env or {}))
    e.pop("TRITON_INTERPRET", None)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), e.get("PYTHONPATH", "")])
    return e


def _run(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, CHECK, "--T", "256", *args], env=_env(tmp_path, env), capture_output=True,
                          text=True, timeout=900)


@pytest.mark.parametrize("shapes", ["k128", "grouped_varlen,k64,k256"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_no_product_operand_overwritten_under_async_wgmma(dtype, shapes, tmp_path):
    """Every kernel specialisation of the four families' inference forward, training forward + backward and decode, at
    K = V = 128 and at the other head layouts (grouped value heads with varlen and a carried-in state, K = V = 64,
    K = 256): no hazard."""
    p = _run(tmp_path, "--dtypes", dtype, "--shapes", shapes)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "0 with a hazard" in p.stdout


@pytest.mark.parametrize("inplace", ["0", "1"])
def test_split_pairwise_form_no_hazard(inplace, tmp_path):
    """The state-tile pass's default pairwise form at level 4 (CHUNKWISE_BWD_DQK_PAIR16=3: q, k tiles feeding both the
    split products and register math, the pattern of triton #6691), its parts accumulated in place or not
    (CHUNKWISE_BWD_SPLIT_INPLACE), for DeltaNet, GDN and simple GLA in bf16 at K = 128, where level 4 takes it, with
    the WY pass's split form (CHUNKWISE_BWD_WY_PAIR16=1) too: no hazard."""
    p = _run(tmp_path, "--dtypes", "bfloat16", "--shapes", "k128", "--fams", "delta,gdn,gla", "-v",
             env={"CHUNKWISE_BWD_DQK_PAIR16": "3", "CHUNKWISE_BWD_WY_PAIR16": "1",
                  "CHUNKWISE_BWD_SPLIT_INPLACE": inplace})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("_bwd_dqk_kernel") == 3 and p.stdout.count("_bwd_wy_kernel") >= 2, p.stdout[-3000:]
    assert "0 with a hazard" in p.stdout, p.stdout[-3000:]


@pytest.mark.parametrize("sides", ["2", "3"])
def test_state_tile_sides_no_hazard(sides, tmp_path):
    """The state-tile pass by side (CHUNKWISE_BWD_DQK_SIDES=2 / 3: each program over all key columns; with a gate the
    key side's ⟨S, dS'⟩ from tiles of its own) for DeltaNet, GDN and simple GLA in bf16 at K = 128: no hazard."""
    p = _run(tmp_path, "--dtypes", "bfloat16", "--shapes", "k128", "--fams", "delta,gdn,gla", "-v",
             env={"CHUNKWISE_BWD_DQK_SIDES": sides})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("_bwd_dqk_sides_kernel") == 3 and "_bwd_dqk_kernel" not in p.stdout, p.stdout[-3000:]
    assert "0 with a hazard" in p.stdout, p.stdout[-3000:]


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


# compiles a family's forward (inference, or training: saved_out) for sm_90 on CPU tensors at B1-T4096-H32 bf16, where
# stage 2 runs beside stage 1 (chunk_fwd's overlap), and prints each compiled kernel's name and shared memory
_FWD_SMEM = """
import glob, json, os, sys
os.environ["CHUNKWISE_WARM_SM90"] = "1"
sys.path.insert(0, sys.argv[1])
import warm_cache
warm_cache.install_sm90()
import torch
from chunkwise.triton.chunk_fwd import chunk_fwd
fam, train = sys.argv[2], sys.argv[3] == "1"
B, T, H, K = 1, 4096, 32, 128
q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(3))
g = (torch.randn(B, T, H, K) if fam == "kda" else torch.randn(B, T, H)) * 0.01 - 0.05
beta = torch.rand(B, T, H, dtype=torch.bfloat16)
chunk_fwd(q, k, v, g, beta, 0.1, None, False, None, saved_out={} if train else None)
for f in glob.glob(os.environ["TRITON_CACHE_DIR"] + "/*/*.json"):
    m = json.load(open(f))
    if "name" in m and "shared" in m:
        print(m["name"], m["shared"])
"""
SM_SMEM, BLOCK_RESERVED = 233472, 1024      # sm_90: shared memory per SM, and what each resident block reserves


@pytest.mark.parametrize("train", ["0", "1"])
@pytest.mark.parametrize("fam", ["gdn", "kda"])
def test_stage1_fits_beside_stage2(fam, train, tmp_path):
    """GDN and KDA at B1 run stage 2's serial programs beside stage 1, whose chunks they wait on: a stage-2 program and a
    stage-1 program must fit one SM's shared memory together, or stage 1 runs only on the SMs stage 2 leaves. Session
    26's first kept-R build stored R through 4 KB more staging (GDN's training stage 2 197200 -> 201296 B) and its
    forward went from 1.4 to 14.6 ms on the H200; session 22 saw KDA at 42.7 ms for the same reason."""
    p = subprocess.run([sys.executable, "-c", _FWD_SMEM, os.path.join(ROOT, "benchmarks"), fam, train],
                       env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    smem = {}
    for line in p.stdout.splitlines():
        name, shared = line.split()
        smem.setdefault(name, []).append(int(shared))
    assert smem.get("chunk_state_output_kernel") and smem.get("chunk_prepare_kernel"), p.stdout
    s2, s1 = max(smem["chunk_state_output_kernel"]), max(smem["chunk_prepare_kernel"])
    assert s2 + s1 + 2 * BLOCK_RESERVED <= SM_SMEM, (s2, s1)


# compiles KDA's forward (inference and training) for sm_90 on CPU tensors under one stage-1 setting, and prints the
# compiled kernels' names
_FWD_BUILD = """
import glob, json, os, sys
os.environ["CHUNKWISE_WARM_SM90"] = "1"
sys.path.insert(0, sys.argv[1])
import warm_cache
warm_cache.install_sm90()
import torch
from chunkwise.triton.chunk_fwd import chunk_fwd
dtype = getattr(torch, sys.argv[2])
B, T, H, K = 1, 256, 2, 64
q, k, v = (torch.randn(B, T, H, K, dtype=dtype) for _ in range(3))
g = torch.randn(B, T, H, K) * 0.01 - 0.05
beta = torch.rand(B, T, H, dtype=dtype)
for saved in (None, {}):
    chunk_fwd(q, k, v, g, beta, 0.1, None, False, None, saved_out=saved)
for f in glob.glob(os.environ["TRITON_CACHE_DIR"] + "/*/*.json"):
    m = json.load(open(f))
    if "name" in m and "shared" in m:
        print(m["name"])
"""


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kda_stage1_form1_builds_for_sm90(dtype, tmp_path):
    """KDA's stage 1 in its second form (CHUNKWISE_PREP_FORM=1, products by 16-row blocks), which no default takes,
    compiles for sm_90. Session 29 found it failing to compile on the H200 only: a helper's tuple default for a
    constexpr argument (the bounds it checks) works under TRITON_INTERPRET=1 and not in a compiled kernel, so the
    interpreter's tests of that form passed in CI."""
    p = subprocess.run([sys.executable, "-c", _FWD_BUILD, os.path.join(ROOT, "benchmarks"), dtype],
                       env=_env(tmp_path, {"CHUNKWISE_PREP_FORM": "1", "CHUNKWISE_PREP_BKC": "16"}),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "chunk_prepare_kernel" in p.stdout.split(), p.stdout


# compiles GDN's and KDA's inference forward for sm_90 on CPU tensors (B1-T256-H2, K = V = 64, bf16) and
# prints, per compiled kernel, how many ex2 instructions of each kind its PTX holds
_EX2_BUILD = """
import glob, os, sys
os.environ["CHUNKWISE_WARM_SM90"] = "1"
sys.path.insert(0, sys.argv[1])
import warm_cache
warm_cache.install_sm90()
import torch
from chunkwise.triton.chunk_fwd import chunk_fwd
B, T, H, K = 1, 256, 2, 64
for fam in ("gdn", "kda"):
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(3))
    g = (torch.randn(B, T, H, K) if fam == "kda" else torch.randn(B, T, H)) * 0.01 - 0.05
    beta = torch.rand(B, T, H, dtype=torch.bfloat16)
    chunk_fwd(q, k, v, g, beta, 0.1, None, False, None)
for f in glob.glob(os.environ["TRITON_CACHE_DIR"] + "/*/*.ptx"):
    ptx = open(f).read()
    name = os.path.basename(f)[:-4]
    print(name, ptx.count("ex2.approx.ftz.f32"), ptx.count("ex2.approx.f32"))
"""


@pytest.mark.parametrize("fast", ["1", "0"])
def test_gate_factors_take_one_ex2(fast, tmp_path):
    """FAST_EXP (chunk_fwd, on by default): every gate factor of GDN's and KDA's forward kernels compiles to
    ex2.approx.ftz.f32 (one MUFU.EX2 in SASS), none to tl.exp's ex2.approx.f32 (whose subnormal handling ptxas wraps
    in a compare and predicated multiplies); CHUNKWISE_FAST_EXP=0 gives back tl.exp's everywhere. The interpreter,
    which runs no PTX, always takes tl.exp, so only a compiled build shows which one a kernel took."""
    p = subprocess.run([sys.executable, "-c", _EX2_BUILD, os.path.join(ROOT, "benchmarks")],
                       env=_env(tmp_path, {"CHUNKWISE_FAST_EXP": fast}), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    counts = {}
    for line in p.stdout.splitlines():
        name, ftz, plain = line.split()
        f0, p0 = counts.get(name, (0, 0))
        counts[name] = (f0 + int(ftz), p0 + int(plain))
    assert counts.get("chunk_prepare_kernel") and counts.get("chunk_state_output_kernel"), p.stdout
    for name in ("chunk_prepare_kernel", "chunk_state_output_kernel"):
        ftz, plain = counts[name]
        assert (ftz > 0 and plain == 0) if fast == "1" else (ftz == 0 and plain > 0), (name, ftz, plain)
