import sys, torch, triton
sys.path.insert(0, "benchmarks")
from bench_forward import shapes, make, run_ours
import chunkwise.triton.chunk_fwd as cf
out = []
for name in sys.argv[1].split(","):
    s = [x for x in shapes() if x["name"] == name][0]
    x = make("gdn", s)
    run_ours("gdn", x); torch.cuda.synchronize()
    ms = triton.testing.do_bench(lambda: run_ours("gdn", x), warmup=50, rep=300)
    out.append(f"{name} {ms:.3f}")
print("FAST_EXP", cf.FAST_EXP, " ".join(out))
