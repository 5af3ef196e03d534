"""GPU diagnosis: every family × dtype × (K, V) of the chunk and recurrent forward, each case in its own
subprocess (an illegal memory access kills only that case), errors against the float64 recurrence.

    python benchmarks/diag_gpu.py [--jobs 8]
"""
import argparse
import itertools
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

CASE = r"""
import sys, torch
sys.path.insert(0, "tests")
from helpers import make_inputs, reference, rel_err, CHUNK_OPS, RECURRENT_OPS
fam, dt, K, V, T, HV, form = sys.argv[1], getattr(torch, sys.argv[2]), *map(int, sys.argv[3:7]), sys.argv[7]
inp = make_inputs(fam, B=1, T=T, H=1, HV=HV, K=K, V=V, dtype=dt, seed=5)
op = CHUNK_OPS[fam] if form == "chunk" else RECURRENT_OPS[fam]
o, h = op(*inp.args(), initial_state=inp.h0, output_final_state=True, backend="triton")
torch.cuda.synchronize() if torch.cuda.is_available() else None
ro, rh = reference(inp)
print(f"o={rel_err(o, ro):.1e} h={rel_err(h, rh):.1e}")
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--fams", default="gdn,kda,delta,gla")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--dims", default="100x60,128x128,64x64,100x128,128x60")
    ap.add_argument("--forms", default="chunk")
    args = ap.parse_args()
    cases = [(f, d, *kv.split("x"), "300", "2", form) for f, d, kv, form in itertools.product(
        args.fams.split(","), args.dtypes.split(","), args.dims.split(","), args.forms.split(","))]
    env = dict(os.environ, CHUNKWISE_POISON="1")

    def one(c):
        p = subprocess.run([sys.executable, "-c", CASE, *c], env=env, capture_output=True, text=True)
        out = (p.stdout + p.stderr).strip().splitlines()
        err = [ln for ln in out if "Error" in ln]
        return out[-1] if p.returncode == 0 else f"rc={p.returncode} {(err or out or [''])[-1][:120]}"

    with ThreadPoolExecutor(args.jobs) as pool:         # each line as its case finishes
        futures = {pool.submit(one, c): c for c in cases}
        for f in as_completed(futures):
            c = futures[f]
            print(f"{c[0]:5s} {c[1]:8s} K={c[2]:>3s} V={c[3]:>3s} {c[6]:5s} {f.result()}", flush=True)


if __name__ == "__main__":
    main()
