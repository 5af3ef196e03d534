"""CPU benchmark: Gated DeltaNet forward, chunkwise's PyTorch backend vs Hugging Face transformers'
``torch_chunk_gated_delta_rule`` (the pure-PyTorch fallback of Qwen3-Next), on the same inputs in one run.

    python benchmarks/bench_cpu.py                 # B=1, T=4096, H=HV=16, K=V=128, fp32
    python benchmarks/bench_cpu.py --T 1024 --reps 3 --out /tmp/bench_cpu.json

Protocol: both functions get the same tensors (q, k, v [B, T, H, K]; g, beta [B, T, HV]; an initial
state [B, HV, K, V]; k already L2-normalised, so neither normalises); calls alternate (chunkwise,
HF, chunkwise, HF, ...) after one warm-up call each, so a load change on the machine hits both;
the median of the timed calls gives the throughput in tokens/s. The process CPU time of each call
is recorded too: with other processes on the machine, wall time at 2 threads is dominated by
OpenMP barriers waiting for a descheduled thread, while 1-thread CPU time stays meaningful.
Correctness: the two outputs and final states against each other, and both against the float64
token recurrence (chunkwise.reference.recurrent) on the first two heads (heads are independent).
HF's function is taken unwrapped (``inspect.unwrap``), so that its own PyTorch code runs even where
fla is installed (HF would otherwise dispatch to fla's kernels).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import chunkwise
from chunkwise.reference.recurrent import recurrent_forward

REQUIRED_RATIO = 3.0  # issue 2: chunkwise's CPU forward at >= 3x HF's throughput


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16, help="q/k heads = value heads")
    p.add_argument("--K", type=int, default=128, help="head dim K = V")
    p.add_argument("--reps", type=int, default=9, help="timed calls of each function (median)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "bench_cpu.json"))
    a = p.parse_args(argv)

    try:
        import transformers
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except ImportError as e:
        sys.exit(f"bench_cpu: needs Hugging Face transformers (pip install -e '.[bench]'): {e}")
    hf = inspect.unwrap(torch_chunk_gated_delta_rule)

    if a.threads:
        torch.set_num_threads(a.threads)
    B, T, H, K = a.B, a.T, a.H, a.K
    gen = torch.Generator().manual_seed(a.seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.5 - 1e-3          # log-decay in (-0.5, 0)
    beta = torch.rand(B, T, H, generator=gen) * 0.9 + 0.05
    h0 = torch.randn(B, H, K, K, generator=gen) * 0.5

    def run_chunkwise():
        return chunkwise.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                backend="torch")

    def run_hf():
        return hf(q, k, v, g, beta, chunk_size=64, initial_state=h0, output_final_state=True)

    load_before = os.getloadavg()
    times = {"chunkwise": [], "hf": []}
    cpu_times = {"chunkwise": [], "hf": []}   # process CPU time: robust to other processes on the machine
    with torch.no_grad():
        outs = {"chunkwise": run_chunkwise(), "hf": run_hf()}       # warm-up, and the outputs compared
        for _ in range(a.reps):
            for name, fn in (("chunkwise", run_chunkwise), ("hf", run_hf)):
                start, cpu_start = time.perf_counter(), time.process_time()
                fn()
                times[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.process_time() - cpu_start)
        load_after = os.getloadavg()

        # correctness: the two against each other, and both against the float64 recurrence on 2 heads
        (o_c, s_c), (o_h, s_h) = outs["chunkwise"], outs["hf"]
        hs = slice(0, min(2, H))
        o_ref, s_ref = recurrent_forward(q[:, :, hs], k[:, :, hs], v[:, :, hs], g[:, :, hs], beta[:, :, hs],
                                         K ** -0.5, h0[:, hs], dtype=torch.float64)
    errors = {
        "o_chunkwise_vs_hf": rel_err(o_c, o_h), "state_chunkwise_vs_hf": rel_err(s_c, s_h),
        "o_chunkwise_vs_fp64_recurrence_2heads": rel_err(o_c[:, :, hs], o_ref),
        "o_hf_vs_fp64_recurrence_2heads": rel_err(o_h[:, :, hs], o_ref),
        "state_chunkwise_vs_fp64_recurrence_2heads": rel_err(s_c[:, hs], s_ref),
        "state_hf_vs_fp64_recurrence_2heads": rel_err(s_h[:, hs], s_ref),
    }
    med = {n: statistics.median(ts) for n, ts in times.items()}
    tps = {n: B * T / m for n, m in med.items()}
    ratio = tps["chunkwise"] / tps["hf"]
    report = {
        "benchmark": "Gated DeltaNet forward (chunk form), fp32, CPU",
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "versions": {"chunkwise": chunkwise.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "git_commit": git_commit(),
        "shape": {"B": B, "T": T, "H": H, "HV": H, "K": K, "V": K, "dtype": "float32", "chunk_size": 64},
        "peer": "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule (unwrapped)",
        "timing": f"time.perf_counter, {a.reps} alternating calls each after 1 warm-up, median",
        "times_s": times,
        "cpu_times_s": cpu_times,
        "median_cpu_time_s": {n: statistics.median(ts) for n, ts in cpu_times.items()},
        "median_s": med,
        "tokens_per_s": tps,
        "ratio_chunkwise_over_hf": ratio,
        "required_ratio": REQUIRED_RATIO,
        "meets_requirement": ratio >= REQUIRED_RATIO,
        "relative_errors": errors,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)

    print(f"GDN forward B={B} T={T} H=HV={H} K=V={K} fp32 on {cpu_name()} ({torch.get_num_threads()} threads), "
          f"load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(f"{'':12s}{'median s':>10s}{'tokens/s':>12s}{'CPU s':>10s}")
    for n in ("chunkwise", "hf"):
        print(f"{n:12s}{med[n]:10.3f}{tps[n]:12,.0f}{statistics.median(cpu_times[n]):10.3f}")
    print(f"ratio chunkwise / HF: {ratio:.2f}x (required >= {REQUIRED_RATIO:.0f}x: "
          f"{'met' if ratio >= REQUIRED_RATIO else 'NOT met'})")
    for n, e in errors.items():
        print(f"rel err {n}: {e:.2e}")
    print(f"wrote {a.out}")
    bad = max(errors.values()) > 1e-4
    if bad:
        print("bench_cpu: outputs disagree beyond 1e-4", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
