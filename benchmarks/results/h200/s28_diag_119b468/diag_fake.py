"""Which launch of the saving forward faults at small bf16 shapes: each case in its own subprocess, launches blocking."""
import itertools, os, subprocess, sys
CASE = r"""
import sys, os, torch, traceback
sys.path.insert(0, "tests")
from helpers import make_inputs
from chunkwise import _custom_ops
fam, K, V, T, save = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
inp = make_inputs(fam, B=1, T=T, H=1, HV=1, K=K, V=V, dtype=torch.bfloat16)
args = (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.25, inp.h0, True, inp.cu_seqlens, None, False, 64, "triton")
try:
    r = (_custom_ops.chunk_fwd_saved if save else _custom_ops.chunk_fwd)(*args)
    torch.cuda.synchronize()
    print("ok", bool(torch.isfinite(r[0]).all()))
except Exception as e:
    tb = [f"{f.name}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__) if "chunkwise" in f.filename]
    print("FAIL", type(e).__name__, str(e)[:80].replace("\n", " "), tb[-3:])
"""
envs = {"default": {}, "saver0": {"CHUNKWISE_SAVE_R": "0"}, "tma0": {"CHUNKWISE_FWD_TMA": "0"}}
cases = [("delta", 128, 16, 20), ("delta", 128, 32, 20), ("delta", 128, 64, 20), ("delta", 128, 128, 20),
         ("delta", 128, 16, 64), ("delta", 128, 16, 200), ("delta", 64, 16, 20), ("delta", 32, 16, 20),
         ("gdn", 128, 16, 20), ("kda", 128, 16, 20), ("gdn", 128, 64, 200), ("kda", 128, 64, 200)]
for (fam, K, V, T), save in itertools.product(cases, ("1", "0")):
    for name, env in envs.items():
        if name != "default" and save == "0":
            continue
        p = subprocess.run([sys.executable, "-c", CASE, fam, str(K), str(V), str(T), save],
                           env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1", **env), capture_output=True, text=True)
        out = (p.stdout.strip().splitlines() or [p.stderr.strip()[-200:]])[-1]
        print(f"{fam} K{K} V{V} T{T} save={save} {name}: {out}", flush=True)
