"""Repeatability of the Triton fwd+bwd on the GPU: the same inputs run several times under each setting; prints,
per setting, the largest relative difference of the output and of every gradient from the setting's first run, and
whether any was not finite. Before each run the caching allocator's free memory is filled with NaN (a 0xFF-filled
tensor allocated and freed), so that a read of memory no launch of that run wrote shows as NaN rather than as the
previous run's value.

--trace: each Triton launch is followed by a synchronize and a fingerprint of every tensor argument (an exact
position-weighted integer sum of its bits); the first launch whose arguments differ between the first two runs
names the kernel. Synchronising every launch takes two-stream races away: a difference that stays is inside a
kernel, one that goes is between launches.

    python benchmarks/repeat_bwd.py --fams gdn --envs "default|CHUNKWISE_BWD_WY_DA_SCR=0" --reps 3
    python benchmarks/repeat_bwd.py --fams gdn --trace --out $OUT
    python benchmarks/repeat_bwd.py --warm ...     # compile only (benchmarks/warm_cache.py --bench)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_forward import env_vars, make, run_ours, shapes  # noqa: E402
from bench_train import leaves  # noqa: E402

_TRACE: list | None = None


def _fingerprint(t: torch.Tensor) -> int:
    """An exact integer of t's bits weighted by position (equal tensors give equal numbers; one changed element
    changes it)."""
    x = t.detach().reshape(-1)
    ity = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    x = x.view(ity).to(torch.int64)
    w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 65521 + 1
    return int((x * w).sum())


def install_trace():
    """Wrap JITFunction.run: after each launch, synchronize and fingerprint its tensor arguments into _TRACE."""
    from triton.runtime.jit import JITFunction
    launch = JITFunction.run

    def traced(self, *args, grid, warmup, **kwargs):
        out = launch(self, *args, grid=grid, warmup=warmup, **kwargs)
        if _TRACE is not None and not warmup:
            torch.cuda.synchronize()
            names = self.arg_names
            vals = list(args) + [kwargs.get(n) for n in names[len(args):]]
            _TRACE.append((self.fn.__name__, [(n, _fingerprint(v)) for n, v in zip(names, vals)
                                              if isinstance(v, torch.Tensor) and v.is_cuda]))
        return out

    JITFunction.run = traced


def scramble():
    """Fill the caching allocator's free memory with 0xFF bytes (NaN in every float dtype)."""
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    n = int(min(free * 0.8 + cached, 48 * 2**30))
    junk = torch.empty(n, dtype=torch.uint8, device="cuda")
    junk.fill_(255)
    del junk


def one_run(fam, x, do, warm):
    grads = leaves(x)
    o, _ = run_ours(fam, x)
    o.backward(do)
    if warm:
        return None
    return {"o": o.detach().float().clone(), **{n: t.grad.detach().float().clone()
                                                 for n, t in zip(("q", "k", "v", "g", "beta"), grads)}}


def main():
    global _TRACE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fams", default="gdn")
    ap.add_argument("--shapes", default="B1-T32768-H32")
    ap.add_argument("--envs", default="default", help="'|'-separated settings, each 'VAR=v,VAR=v' or 'default'")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    div = 64 if a.warm else 1
    shp = {s["name"]: s for s in shapes(div)}
    rows = []
    if a.trace and not a.warm:
        install_trace()
    for fam in a.fams.split(","):
        for sname in a.shapes.split(","):
            torch.manual_seed(0)
            x = make(fam, shp[sname])
            do = torch.randn_like(x["v"])
            for e in a.envs.split("|"):
                env = {} if e == "default" else dict(p.split("=", 1) for p in e.split(",") if p)
                with env_vars(env):
                    if a.warm:
                        one_run(fam, x, do, True)
                        continue
                    runs, traces = [], []
                    for _ in range(a.reps):
                        scramble()
                        _TRACE = [] if a.trace else None
                        runs.append(one_run(fam, x, do, False))
                        traces.append(_TRACE)
                        _TRACE = None
                diffs = {n: max(((r[n] - runs[0][n]).norm() / runs[0][n].norm()).item() for r in runs[1:])
                         for n in runs[0]} if len(runs) > 1 else {}
                finite = all(bool(torch.isfinite(t).all()) for r in runs for t in r.values())
                row = dict(family=fam, shape=sname, env=e, reps=a.reps, finite=finite, rel_diff=diffs)
                if a.trace and len(traces) > 1:
                    first = None
                    for i, ((k0, f0), (k1, f1)) in enumerate(zip(traces[0], traces[1])):
                        bad = [n for (n, v0), (_, v1) in zip(f0, f1) if v0 != v1]
                        if bad:
                            first = dict(launch=i, kernel=k0, args=bad)
                            break
                    row["trace"] = dict(launches=len(traces[0]), first_diff=first,
                                        kernels=[k for k, _ in traces[0]])
                rows.append(row)
                worst = max(diffs.values()) if diffs else 0.0
                print(f"{fam:6s} {sname:22s} {e:60s} finite={finite} worst={worst:.2e} "
                      + " ".join(f"{n}={v:.1e}" for n, v in diffs.items())
                      + (f"  first diff: {row['trace']['first_diff']}" if "trace" in row else ""), flush=True)
            del x, do
    if a.out and not a.warm:
        with open(os.path.join(a.out, "repeat_bwd.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
