"""Decode benchmark: one token per sequence (T = 1), GDN (and a KDA row), H = HV = 32, K = V = 128.

chunkwise's triton recurrent kernel vs fla's fused_recurrent on the same inputs in the same process,
and the device-to-device copy bandwidth of the same run as the yardstick: decode reads and writes
each state once, so its floor is (state read + state write) / copy bandwidth.

Modes:
  state  initial_state [B, HV, K, V] (fp32 or bf16) -> a new fp32 final state (what fla's public op does)
  pool   vLLM-style pool [P, HV, K, V] (fp32 or bf16) addressed by state_indices, updated in place
         (fla 0.6.0's GDN op has no pool; its KDA op has one through fused_recurrent_kda_fwd)

Timing: triton.testing.do_bench median (it flushes L2 between calls): "op" is the public op with all
its Python (checks, custom-op dispatch, launch), "kernel" is our launcher alone, "graph" replays a
CUDA graph of the public op (what a serving engine does for decode: GPU time only).

Usage: PYTHONPATH=src python benchmarks/bench_decode.py [--out DIR] [--quick]
Writes bench_decode.json (GPU, versions, commit, every number) to --out (default $OUT or .).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

import torch
import triton
from triton.testing import do_bench

import chunkwise
from chunkwise.triton.recurrent import _launch_config, recurrent_fwd

try:
    import fla
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_gdn
    from fla.ops.kda import fused_recurrent_kda as fla_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_kda_fwd
except Exception as e:  # noqa: BLE001
    print(f"fla not available: {e!r}")
    fla = fla_gdn = fla_kda = fla_kda_fwd = None

H = HV = 32
K = V = 128
DEV = "cuda"


def ms(fn, rep=60):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_ms(fn, rep=60):
    """Median time of replaying a CUDA graph of fn (GPU time, no Python)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return do_bench(g.replay, warmup=25, rep=rep, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"  graph capture failed: {e!r}")
        return None


def copy_bandwidth():
    n = 1 << 28                                                    # 1 GiB of fp32
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / (t * 1e-3) / 1e12                          # TB/s, read + write


def inputs(B, fam="gdn", seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    q = r(B, 1, H, K).bfloat16()
    k = torch.nn.functional.normalize(r(B, 1, H, K), dim=-1).bfloat16()
    v = r(B, 1, HV, V).bfloat16()
    if fam == "gdn":
        g = torch.nn.functional.logsigmoid(r(B, 1, HV) + 3)       # fp32, in (-inf, 0)
    else:
        g = torch.nn.functional.logsigmoid(r(B, 1, HV, K) + 3)
    beta = torch.sigmoid(r(B, 1, HV)).bfloat16()
    return q, k, v, g, beta


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def state_bytes(B, read_dtype, write_dtype):
    e = B * HV * K * V
    return e * (torch.finfo(read_dtype).bits + torch.finfo(write_dtype).bits) // 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="skip the launch-configuration sweep")
    args = ap.parse_args()

    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw:.2f} TB/s")
    rows, sweep = [], []

    def row(**kw):
        t = kw.get("graph_us") or kw.get("op_us")
        if kw.get("bytes") and t:
            kw["TBps"] = kw["bytes"] / (t * 1e-6) / 1e12
            kw["of_copy"] = kw["TBps"] / bw
        rows.append(kw)

    for B in (1, 64, 256):
        q, k, v, g, beta = inputs(B)
        for sdt in (torch.float32, torch.bfloat16):
            h0 = (torch.randn(B, HV, K, V, device=DEV) * 0.1).to(sdt)
            sname = str(sdt).split(".")[-1]

            # -- state mode: h0 -> new fp32 final state, ours vs fla
            ours = lambda: chunkwise.fused_recurrent_gated_delta_rule(  # noqa: E731
                q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
            kern = lambda: recurrent_fwd(q, k, v, g, beta, K ** -0.5, h0, True, None)  # noqa: E731
            nbytes = state_bytes(B, sdt, torch.float32)
            o1, ht1 = ours()
            r = dict(family="gdn", B=B, state=sname, mode="state", bytes=nbytes,
                     op_us=ms(ours) * 1e3, kernel_us=ms(kern) * 1e3, graph_us=(graph_ms(ours) or 0) * 1e3)
            if fla_gdn is not None:
                f = lambda: fla_gdn(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,  # noqa: E731
                                    output_final_state=True)
                o2, ht2 = f()
                r.update(fla_op_us=ms(f) * 1e3, fla_graph_us=(graph_ms(f) or 0) * 1e3,
                         vs_fla_o=rel(o1, o2), vs_fla_state=rel(ht1, ht2))
            row(**r)

            # -- pool mode: in place, P = B + 32 slots, a random slot per sequence, some padding (-1) at B > 1
            P = B + 32
            pool = (torch.randn(P, HV, K, V, device=DEV) * 0.1).to(sdt)
            idx = torch.randperm(P, device=DEV)[:B].to(torch.int32)
            live = B if B == 1 else B - B // 16
            if B > 1:
                idx[live:] = -1
            pooled = lambda: chunkwise.fused_recurrent_gated_delta_rule(  # noqa: E731
                q, k, v, g, beta, initial_state=pool, state_indices=idx, backend="triton")
            pkern = lambda: recurrent_fwd(q, k, v, g, beta, K ** -0.5, pool, False, None,  # noqa: E731
                                          state_indices=idx)
            row(family="gdn", B=B, state=sname, mode="pool", live=live, bytes=state_bytes(live, sdt, sdt),
                op_us=ms(pooled) * 1e3, kernel_us=ms(pkern) * 1e3, graph_us=(graph_ms(pooled) or 0) * 1e3)
            if B == 256:   # the vLLM / FlashInfer state layout [P, HV, V, K]
                pool_t = pool.transpose(-1, -2).contiguous()
                pt = lambda: chunkwise.fused_recurrent_gated_delta_rule(  # noqa: E731
                    q, k, v, g, beta, initial_state=pool_t, state_indices=idx, transpose_state_layout=True,
                    backend="triton")
                row(family="gdn", B=B, state=sname, mode="pool[V,K]", live=live, bytes=state_bytes(live, sdt, sdt),
                    op_us=ms(pt) * 1e3, graph_us=(graph_ms(pt) or 0) * 1e3)
            del h0, pool
        torch.cuda.empty_cache()

    # -- KDA decode, batch 256, fp32 state
    B = 256
    q, k, v, g, beta = inputs(B, "kda")
    h0 = torch.randn(B, HV, K, V, device=DEV) * 0.1
    ours = lambda: chunkwise.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,  # noqa: E731
                                                 output_final_state=True, backend="triton")
    r = dict(family="kda", B=B, state="float32", mode="state", bytes=state_bytes(B, torch.float32, torch.float32),
             op_us=ms(ours) * 1e3, graph_us=(graph_ms(ours) or 0) * 1e3)
    if fla_kda is not None:
        f = lambda: fla_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True)  # noqa: E731
        o1, ht1 = ours()
        o2, ht2 = f()
        r.update(fla_op_us=ms(f) * 1e3, fla_graph_us=(graph_ms(f) or 0) * 1e3,
                 vs_fla_o=rel(o1, o2), vs_fla_state=rel(ht1, ht2))
    row(**r)
    pool = torch.randn(B + 32, HV, K, V, device=DEV) * 0.1
    idx = torch.randperm(B + 32, device=DEV)[:B].to(torch.int32)
    pooled = lambda: chunkwise.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool,  # noqa: E731
                                                   state_indices=idx, backend="triton")
    r = dict(family="kda", B=B, state="float32", mode="pool", live=B,
             bytes=state_bytes(B, torch.float32, torch.float32), op_us=ms(pooled) * 1e3,
             graph_us=(graph_ms(pooled) or 0) * 1e3)
    if fla_kda_fwd is not None:
        f = lambda: fla_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, inplace_final_state=True,  # noqa: E731
                                ssm_state_indices=idx)
        r.update(fla_op_us=ms(f) * 1e3, fla_graph_us=(graph_ms(f) or 0) * 1e3)
    row(**r)
    del h0, pool

    # -- launch-configuration / variant sweep (kernel only, GDN pool in place)
    #    fused: both products of S in one pass (o = S'ᵀq + (kᵀq)u); stream: evict-first load, .cs store;
    #    pipeline: num_stages of the token loop (0 = the while loop)
    if not args.quick:
        F32, BF16 = torch.float32, torch.bfloat16
        plan = {  # (B, state dtype, fused, stream, pipeline): [(BV, num_warps), ...]
            (256, F32, False, False, 2): [(16, 1), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (128, 8)],
            (256, F32, False, False, 0): [(32, 2), (32, 4)],        # the while loop of the first measurement
            (256, F32, True, False, 2): [(32, 2), (32, 4)],
            (256, F32, False, True, 2): [(32, 4)],
            (256, BF16, False, False, 2): [(32, 2), (32, 4), (64, 4)],
            (1, F32, False, False, 2): [(8, 1), (16, 1), (16, 2)],
            (1, F32, False, False, 0): [(8, 1)],
        }
        for (B, sdt, fused, stream, pipe), cfgs in plan.items():
            q, k, v, g, beta = inputs(B)
            pool = (torch.randn(B, HV, K, V, device=DEV) * 0.1).to(sdt)
            idx = torch.randperm(B, device=DEV).to(torch.int32)
            auto = _launch_config(q.device, B * HV, K, V)
            for BV, nw in cfgs:
                fn = lambda: recurrent_fwd(q, k, v, g, beta, K ** -0.5, pool, False, None,  # noqa: E731
                                           state_indices=idx, BV=BV, num_warps=nw, fused=fused, stream=stream,
                                           pipeline=pipe)
                t = (graph_ms(fn, rep=30) if B == 1 else ms(fn, rep=30)) * 1e3
                sweep.append(dict(B=B, state=str(sdt).split(".")[-1], BV=BV, num_warps=nw, fused=fused,
                                  stream=stream, pipeline=pipe, us=t, timing="graph" if B == 1 else "do_bench",
                                  TBps=state_bytes(B, sdt, sdt) / (t * 1e-6) / 1e12,
                                  auto=(BV, nw, fused, stream, pipe) == (*auto[1:], False, False, 2)))
            del pool

    # -- report
    print(f"\nGDN/KDA decode, T=1, H=HV={H}, K=V={K}, bf16 q/k/v, on {torch.cuda.get_device_name()}; "
          f"copy {bw:.2f} TB/s; times in us (do_bench median)")
    hdr = f"{'fam':4} {'B':>4} {'state':9} {'mode':10} {'op':>8} {'kernel':>8} {'graph':>8} {'TB/s':>6} {'%copy':>6}" \
          f" {'fla op':>8} {'fla gr':>8} {'vs fla o':>9}"
    print(hdr)
    for r in rows:
        f = lambda key, fmt="8.1f": (format(r[key], fmt) if r.get(key) else "-").rjust(int(fmt.split(".")[0]))  # noqa: E731
        print(f"{r['family']:4} {r['B']:>4} {r['state']:9} {r['mode']:10} {f('op_us')} {f('kernel_us')} "
              f"{f('graph_us')} {f('TBps', '6.2f')} {(format(100 * r['of_copy'], '6.1f') if r.get('of_copy') else '-'):>6}"
              f" {f('fla_op_us')} {f('fla_graph_us')} {(format(r['vs_fla_o'], '9.1e') if r.get('vs_fla_o') else '-'):>9}")
    if sweep:
        print("\nsweep (GDN pool in place; B=1 graph replay, B=256 do_bench): "
              "B state BV warps fused stream pipeline us TB/s %copy default")
        for x in sweep:
            print(f"  {x['B']:>4} {x['state']:9} {x['BV']:>3} {x['num_warps']:>2} {x['fused']:d} {x['stream']:d} {x['pipeline']} "
                  f"{x['us']:8.1f} {x['TBps']:6.2f} {100 * x['TBps'] / bw:6.1f} {'*' if x['auto'] else ''}")

    commit = os.environ.get("GIT_COMMIT") or os.environ.get("CHUNKWISE_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL).strip()
        except Exception:  # noqa: BLE001
            commit = "unknown"
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                fla=getattr(fla, "__version__", None), commit=commit, H=H, HV=HV, K=K, V=V, T=1,
                copy_TBps=bw, timing="triton.testing.do_bench median, L2 flushed between calls")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows, sweep=sweep), fh, indent=1)


if __name__ == "__main__":
    main()
