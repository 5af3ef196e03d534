"""The kernels as compiled for Hopper (sm_90) without a GPU: Triton's stand-in driver (benchmarks/tools.py) builds
every launch to PTX from CPU tensors, and these tests read what the compiler made of it.

- No pipelined loop copies into a shared buffer that an unwaited async wgmma may still read (tests/sm90_hazards.py):
  triton 3.6 gives a loaded tile that feeds both an async product and a register load one buffer too few (triton
  #6691); the backward's ⟨S, dS'⟩ hit it on the H200 and GDN's gradients changed from run to run. The GPU shows the
  symptom only where timing lets the copy win the race; this looks at the code itself, on every machine.
- Stage 2 and stage 1 fit one SM's shared memory together (they run side by side).
- Every gate factor compiles to one ex2.approx.ftz.f32.
Each build runs in a subprocess: the stand-in driver is installed for the whole process.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "tests", "sm90_hazards.py")
TOOLS = os.path.join(ROOT, "benchmarks")


def _env(tmp_path, env=None):
    """A compiling subprocess's environment: its own Triton cache, no interpreter, the package on the path, no GPU in
    sight (on a GPU machine the ops refuse the CPU tensors that the stand-in driver builds from)."""
    e = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="", **(env or {}))
    e.pop("TRITON_INTERPRET", None)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), e.get("PYTHONPATH", "")])
    return e


def _run(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, CHECK, "--T", "256", *args], env=_env(tmp_path, env), capture_output=True,
                          text=True, timeout=900)


@pytest.mark.parametrize("dtype,shapes", [("bfloat16", "k128"), ("float16", "grouped_varlen")])
def test_no_product_operand_overwritten_under_async_wgmma(dtype, shapes, tmp_path):
    """Every kernel specialisation of the four families' inference forward, training forward + backward and decode, at
    K = V = 128 and at the other head layouts (grouped value heads with varlen and a carried-in state, K = V = 64,
    K = 256): no hazard."""
    p = _run(tmp_path, "--dtypes", dtype, "--shapes", shapes)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "0 with a hazard" in p.stdout


# the shape of an earlier _bwd_dqk_kernel loop (TTGIR, trimmed): S feeds the product dq (async, not waited in the
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
    from sm90_hazards import hazards
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
sys.path.insert(0, sys.argv[1])
import tools
tools.install_sm90(ptx_only=True)
import torch
from chunkwise.triton.chunk import chunk_fwd
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
    stage-1 program must fit one SM's shared memory together, or stage 1 runs only on the SMs stage 2 leaves (a build
    that staged one more store through shared memory made GDN's training forward ten times slower)."""
    p = subprocess.run([sys.executable, "-c", _FWD_SMEM, TOOLS, fam, train],
                       env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    smem = {}
    for line in p.stdout.splitlines():
        name, shared = line.split()
        smem.setdefault(name, []).append(int(shared))
    assert smem.get("chunk_state_output_kernel") and smem.get("chunk_prepare_kernel"), p.stdout
    s2, s1 = max(smem["chunk_state_output_kernel"]), max(smem["chunk_prepare_kernel"])
    assert s2 + s1 + 2 * BLOCK_RESERVED <= SM_SMEM, (s2, s1)


# compiles GDN's and KDA's inference forward for sm_90 on CPU tensors (B1-T256-H2, K = V = 64, bf16) and
# prints, per compiled kernel, how many ex2 instructions of each kind its PTX holds
_EX2_BUILD = """
import glob, os, sys
sys.path.insert(0, sys.argv[1])
import tools
tools.install_sm90(ptx_only=True)
import torch
from chunkwise.triton.chunk import chunk_fwd
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


def test_gate_factors_take_one_ex2(tmp_path):
    """Every gate factor of GDN's and KDA's forward kernels compiles to ex2.approx.ftz.f32 (one MUFU.EX2 in SASS),
    none to tl.exp's ex2.approx.f32 (whose subnormal handling ptxas wraps in a compare and predicated multiplies).
    The interpreter, which runs no PTX, always takes tl.exp, so only a compiled build shows which one a kernel took."""
    p = subprocess.run([sys.executable, "-c", _EX2_BUILD, TOOLS], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    counts = {}
    for line in p.stdout.splitlines():
        name, ftz, plain = line.split()
        f0, p0 = counts.get(name, (0, 0))
        counts[name] = (f0 + int(ftz), p0 + int(plain))
    assert counts.get("chunk_prepare_kernel") and counts.get("chunk_state_output_kernel"), p.stdout
    for name in ("chunk_prepare_kernel", "chunk_state_output_kernel"):
        ftz, plain = counts[name]
        assert ftz > 0 and plain == 0, (name, ftz, plain)


def test_mem_tool_counts_a_training_step(tmp_path):
    """benchmarks/tools.py mem, the peak memory of a training step from the launchers' allocations on CPU tensors: a
    GDN step at 2 / 8 heads and 8192 tokens (bf16, K = V = 128) holds at least the per-chunk states and their
    gradients (2 · chunks · HV · K · V, bf16) beside dq and dk per value head; on a GPU the step's
    torch.cuda.max_memory_allocated above its inputs agrees within 2 MiB."""
    p = subprocess.run([sys.executable, os.path.join(TOOLS, "tools.py"), "mem", "--ops", "gdn", "--shapes",
                        "B1-T8192-H2-HV8"], env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    mib = float(p.stdout.split()[-2])
    floor = (2 * (8192 // 64) * 8 * 128 * 128 * 2 + 2 * 8192 * 8 * 128 * 2) / 2 ** 20
    assert mib >= floor, (mib, floor)
    import torch
    if torch.cuda.is_available():
        import chunkwise
        x = [torch.zeros(1, 8192, h, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True) for h in (2, 2, 8)]
        g = torch.zeros(1, 8192, 8, device="cuda", requires_grad=True)
        beta = torch.zeros(1, 8192, 8, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        do = torch.zeros(1, 8192, 8, 128, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):          # (the first step compiles)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            o, _ = chunkwise.chunk_gated_delta_rule(*x, g, beta, backend="triton")
            o.backward(do)
            del o
            for t in (*x, g, beta):
                t.grad = None
            torch.cuda.synchronize()
        gpu = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        assert abs(gpu - mib) <= 2, (gpu, mib)
