"""Each launch of KDA's pairwise-gradient kernel (`_bwd_pair_kernel`) timed on its own, in launch order, for one
fwd+bwd at B1-T32768-H32 bf16 with the one-reference forms on (the defaults) and off: the profiler's per-kernel
sums (sweep_bwd.py) add the launches up. Gates as bench_forward draws them (CHUNKWISE_BENCH_GATE_SCALE).

    python benchmarks/pair_launches.py [--warm]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_forward import env_vars, make, run_ours, shapes  # noqa: E402
from bench_train import fwd_bwd, leaves, profiled  # noqa: E402

SETTINGS = {"on": {}, "off": {"CHUNKWISE_KDA_ONE_REF": "0", "CHUNKWISE_BWD_ONE_REF": "0"}}


def launches(fn, grads, name="_bwd_pair_kernel"):
    """(kernel name, ms) of every device event of fn whose name starts with ``name``, in launch order."""
    evs = [e for e in profiled(fn, grads).events() if e.name.startswith(name) and getattr(e, "device_type", None) is not None
           and str(e.device_type).endswith("CUDA")]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name[:40], e.time_range.elapsed_us() / 1e3) for e in evs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", action="store_true", help="compile only")
    a = ap.parse_args()
    shape = next(s for s in shapes(4 if a.warm else 1) if s["name"] == "B1-T32768-H32")
    x = make("kda", shape)
    do = torch.randn_like(x["v"])
    for name, env in SETTINGS.items():
        with env_vars(env):
            grads = leaves(x)
            f = fwd_bwd(lambda: run_ours("kda", x), do)
            if a.warm:
                f()
                continue
            rows = launches(f, grads)
            print(f"{name}: " + "  ".join(f"{ms:.3f}" for _, ms in rows) + f"  (sum {sum(ms for _, ms in rows):.3f} ms)",
                  flush=True)


if __name__ == "__main__":
    main()
