"""Training benchmark (forward + backward) of the Triton chunk ops against fla, same inputs, same process.

    PYTHONPATH=src python3 benchmarks/bench_train.py [--out DIR] [--families gdn,kda,delta,gla] [--shapes ...]
                                                     [--profile]

Shapes as benchmarks/bench_forward.py (K = V = 128, bf16): B1-T32768-H32, B8-T4096-H32,
B4-T8192-H16/HV32, varlen 16 sequences / 32768 tokens. For each: our forward alone (no grad), our training
forward alone (under autograd: what it keeps for the backward, no backward), our fwd+bwd (o.backward(do),
gradients of q, k, v, g, beta), fla's fwd+bwd, triton.testing.do_bench
medians in ms, and the peak memory of one fwd+bwd above the inputs (torch.cuda.max_memory_allocated).
--profile adds a per-kernel time breakdown (torch.profiler) of one fwd+bwd at the first shape.
Writes bench_train.json (GPU, versions, commit, every number) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_forward import (FAMILIES, fla_autotune_picks, fla_fn, fla_fresh_search, make, run_fla,  # noqa: E402
                           run_ours, shapes)


def leaves(x):
    out = []
    for n in ("q", "k", "v", "g", "beta"):
        if x[n] is not None:
            x[n] = x[n].detach().requires_grad_(True)
            out.append(x[n])
    return out


def fwd_bwd(run, do):
    def f():
        o, _ = run()
        o.backward(do)
    return f


def peak_mb(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(fn, grads):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, grad_to_none=grads, return_mode="median")


def profiled(fn, grads=()):
    """The torch profiler (CUDA activity) of one call of fn, after a warm-up call, its leaves' gradients reset
    first (as do_bench's grad_to_none does: otherwise autograd's accumulation into .grad shows up as elementwise
    kernels)."""
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    for t in grads:
        t.grad = None
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return p


def profile(fn, grads=(), top=14):
    """Device time per kernel name (ms) of one call of fn (``profiled``), the ``top`` largest."""
    p = profiled(fn, grads)
    rows = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows[e.key[:60]] = rows.get(e.key[:60], 0) + t / 1000
    return dict(sorted(rows.items(), key=lambda kv: -kv[1])[:top])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--shapes", default="")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-families", default="", help="time fla only for these (default: every family)")
    a = ap.parse_args()
    fams = a.families.split(",")
    os.environ["CHUNKWISE_POISON"] = "0"
    torch.manual_seed(0)
    results = []
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, dtype="bfloat16",
                K=128, V=128)
    try:
        import fla
        meta["fla"] = fla.__version__
    except Exception:  # noqa: BLE001
        meta["fla"] = None
    meta["commit"] = os.environ.get("GIT_COMMIT")     # the device's copy may carry a stale .git
    if not meta["commit"]:
        try:
            meta["commit"] = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:  # noqa: BLE001
            meta["commit"] = None
    os.makedirs(a.out, exist_ok=True)
    first = True
    sel = [s for s in shapes() if not a.shapes or s["name"] in a.shapes.split(",")]
    for s in sel:
        for fam in fams:
            x = make(fam, s)
            grads = leaves(x)
            do = torch.randn_like(x["v"])
            row = dict(shape=s["name"], family=fam)
            with torch.no_grad():
                row["ours_fwd_ms"] = bench(lambda: run_ours(fam, x), None)
            # the training forward alone (under autograd: it keeps stage 1 and R for the backward), no backward
            row["ours_train_fwd_ms"] = bench(lambda: run_ours(fam, x), None)
            f_ours = fwd_bwd(lambda: run_ours(fam, x), do)
            os.environ["CHUNKWISE_POISON"] = "1"        # one poisoned pass: every gradient finite
            f_ours()
            row["grads_finite"] = all(bool(torch.isfinite(t.grad).all()) for t in grads)
            os.environ["CHUNKWISE_POISON"] = "0"
            row["ours_fwdbwd_ms"] = bench(f_ours, grads)
            row["ours_peak_mb"] = peak_mb(f_ours)
            if a.profile and first:
                row["ours_profile_ms"] = profile(f_ours, grads)
            skip_fla = a.no_fla or (a.fla_families and fam not in a.fla_families.split(","))
            f = None if skip_fla else fla_fn(fam)
            if f is not None:   # ours first, so that a run cut while fla compiles and autotunes still reports it
                print(json.dumps(dict(row, partial="ours only, fla next")), flush=True)
                f_fla = fwd_bwd(lambda: run_fla(fam, f, x), do)
                try:
                    fla_fresh_search()      # (no picks kept on disk or from another shape: bench_forward)
                    with torch.no_grad():
                        row["fla_fwd_ms"] = bench(lambda: run_fla(fam, f, x), None)
                    row["fla_fwdbwd_ms"] = bench(f_fla, grads)
                    row["fla_configs"] = fla_autotune_picks()
                    row["fla_peak_mb"] = peak_mb(f_fla)
                    row["speedup"] = row["fla_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
                    if a.profile and first:     # fla's kernels beside ours: which of its passes beat their peers
                        row["fla_profile_ms"] = profile(f_fla, grads, top=24)
                except Exception as e:  # noqa: BLE001
                    row["fla_error"] = repr(e)[:200]
            row["bwd_over_fwd"] = row["ours_fwdbwd_ms"] / row["ours_fwd_ms"]
            results.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(a.out, "bench_train.json"), "w") as fh:
                json.dump(dict(meta=meta, results=results), fh, indent=1)
            del x, grads, do
            torch.cuda.empty_cache()
        first = False

    print(f"\n{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  fla {meta['fla']}  commit {str(meta['commit'])[:10]}")
    print(f"{'shape':22s} {'fam':6s} {'fwd ms':>7s} {'trn fwd':>7s} {'f+b ms':>7s} {'fla f+b':>8s} {'x fla':>6s} "
          f"{'f+b/fwd':>7s} {'peak MB':>8s} {'fla MB':>8s} finite")
    nan = float("nan")
    for r in results:
        print(f"{r['shape']:22s} {r['family']:6s} {r['ours_fwd_ms']:7.2f} {r['ours_train_fwd_ms']:7.2f} {r['ours_fwdbwd_ms']:7.2f} "
              f"{r.get('fla_fwdbwd_ms', nan):8.2f} {r.get('speedup', nan):6.2f} {r['bwd_over_fwd']:7.2f} "
              f"{r['ours_peak_mb']:8.0f} {r.get('fla_peak_mb', nan):8.0f} {r['grads_finite']}")


if __name__ == "__main__":
    main()
