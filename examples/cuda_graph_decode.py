"""Serving: capture the decode op and a layer's decode step in a CUDA graph, replay, check == eager.

What makes a decode step capturable: fixed shapes, fixed addresses, no host syncs. chunkwise's
recurrent op reads no tensor values on the host (without cu_seqlens), and a static
`LinearAttentionCache` updates its conv / recurrent state buffers in place with ``copy_``; the
state-pool form of the op (``state_indices``) writes the pool in place by itself.

Three checks, each over several steps with new random inputs copied into the static buffers:

1. op, state pool:   fused_recurrent_gated_delta_rule(q, k, v, g, β, initial_state=pool, state_indices=slots)
2. op, state in/out: fused_recurrent_kda(..., initial_state=S, output_final_state=True); S.copy_(S_new)
3. layer:            GatedDeltaNet / KimiDeltaAttention decode step with a static cache, after an eager prefill

and a timing of eager vs graph replay per decode step.

    python examples/cuda_graph_decode.py                     # on a GPU (triton backend)
    python examples/cuda_graph_decode.py --device cpu        # no capture: the same static-buffer
                                                             # flow run eagerly (a logic check)
Exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import chunkwise
from chunkwise.layers import GatedDeltaNet, KimiDeltaAttention, LinearAttentionCache


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Step:
    """A step function over static buffers: captured into a CUDA graph on the GPU, called directly on the CPU."""

    def __init__(self, fn, device):
        self.fn = fn
        self.graph = None
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):          # warm-up (Triton compiles, allocator settles)
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


def check(name, got, want, tol, failures):
    err = rel_err(got, want)
    ok = err <= tol
    print(f"  {name:<44s} rel err {err:.2e}  {'ok' if ok else 'MISMATCH'}")
    if not ok:
        failures.append(name)


def op_pool(args, device, dtype, failures):
    print("1. fused_recurrent_gated_delta_rule over a state pool (in place)")
    B, H, HV, K, V, P = args.batch, 4, 8, args.head_dim, args.head_dim, args.batch + 3
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(device)

    q, k, v = rnd(B, 1, H, K).to(dtype), rnd(B, 1, H, K).to(dtype), rnd(B, 1, HV, V).to(dtype)
    g, beta = torch.zeros(B, 1, HV, device=device), torch.zeros(B, 1, HV, device=device, dtype=dtype)
    pool = rnd(P, HV, K, V) * 0.1
    slots = torch.randperm(P, generator=gen)[:B].to(device)
    slots[1] = -1                                                         # a padding slot

    def step():
        o, _ = chunkwise.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=slots,
                                                          use_qk_l2norm_in_kernel=True, backend=args.backend)
        return o

    pool_eager = pool.clone()
    graph = Step(step, device)
    pool.copy_(pool_eager)                                                # undo the warm-up's writes
    for t in range(args.steps):
        for x, new in ((q, rnd(B, 1, H, K)), (k, rnd(B, 1, H, K)), (v, rnd(B, 1, HV, V)),
                       (g, -torch.rand(B, 1, HV, generator=gen).to(device) * 0.5),
                       (beta, torch.rand(B, 1, HV, generator=gen).to(device))):
            x.copy_(new)
        o_graph = graph().clone()
        o_eager, _ = chunkwise.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool_eager,
                                                                state_indices=slots, use_qk_l2norm_in_kernel=True,
                                                                backend=args.backend)
        tol = 1e-6 if dtype == torch.float32 else 1e-3
        check(f"step {t}: o", o_graph, o_eager, tol, failures)
        check(f"step {t}: pool", pool, pool_eager, tol, failures)


def op_state(args, device, dtype, failures):
    print("2. fused_recurrent_kda with initial_state / output_final_state into a static state")
    B, H, K, V = args.batch, 4, args.head_dim, args.head_dim
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(device)

    q, k, v = rnd(B, 1, H, K).to(dtype), rnd(B, 1, H, K).to(dtype), rnd(B, 1, H, V).to(dtype)
    g, beta = torch.zeros(B, 1, H, K, device=device), torch.zeros(B, 1, H, device=device, dtype=dtype)
    S = rnd(B, H, K, V) * 0.1

    def step():
        o, S_new = chunkwise.fused_recurrent_kda(q, k, v, g, beta, initial_state=S, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True, backend=args.backend)
        S.copy_(S_new)
        return o

    S0 = S.clone()
    graph = Step(step, device)
    S.copy_(S0)
    S_eager = S0.clone()
    for t in range(args.steps):
        for x, new in ((q, rnd(B, 1, H, K)), (k, rnd(B, 1, H, K)), (v, rnd(B, 1, H, V)),
                       (g, -torch.rand(B, 1, H, K, generator=gen).to(device) * 0.5),
                       (beta, torch.rand(B, 1, H, generator=gen).to(device))):
            x.copy_(new)
        o_graph = graph().clone()
        o_eager, S_eager = chunkwise.fused_recurrent_kda(q, k, v, g, beta, initial_state=S_eager,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                         backend=args.backend)
        tol = 1e-6 if dtype == torch.float32 else 1e-3
        check(f"step {t}: o", o_graph, o_eager, tol, failures)
        check(f"step {t}: state", S, S_eager, tol, failures)


def layer_decode(args, device, dtype, failures, kind):
    print(f"3. {kind} decode step with a static LinearAttentionCache")
    torch.manual_seed(2)
    D = args.hidden
    if kind == "GatedDeltaNet":
        layer = GatedDeltaNet(D, num_k_heads=4, num_v_heads=8, head_k_dim=args.head_dim, head_v_dim=args.head_dim,
                              layer_idx=0, backend=args.backend)
    else:
        layer = KimiDeltaAttention(D, num_heads=4, head_dim=args.head_dim, layer_idx=0, backend=args.backend)
    layer = layer.to(device=device, dtype=dtype).eval()
    B = args.batch
    gen = torch.Generator(device="cpu").manual_seed(3)
    prompt = torch.randn(B, args.prompt, D, generator=gen).to(device, dtype)
    tokens = torch.randn(args.steps, B, 1, D, generator=gen).to(device, dtype)

    with torch.no_grad():
        static = LinearAttentionCache.allocate([layer], B, device=device, dtype=dtype)
        layer(prompt, cache=static)                                       # eager prefill into the static buffers
        saved = [static.get(0).conv_state.clone(), static.get(0).recurrent_state.clone()]
        _, dynamic = layer(prompt, use_cache=True)                        # the eager reference
        x = torch.zeros(B, 1, D, device=device, dtype=dtype)

        def step():
            y, _ = layer(x, cache=static)
            return y

        graph = Step(step, device)
        static.get(0).conv_state.copy_(saved[0])                          # undo the warm-up's writes
        static.get(0).recurrent_state.copy_(saved[1])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for t in range(args.steps):
            x.copy_(tokens[t])
            y_graph = graph().clone()
            y_eager, dynamic = layer(tokens[t], cache=dynamic)
            check(f"step {t}: y", y_graph, y_eager, tol, failures)
        check("recurrent state after the steps", static.get(0).recurrent_state, dynamic.get(0).recurrent_state,
              tol, failures)
        check("conv state after the steps", static.get(0).conv_state, dynamic.get(0).conv_state, tol, failures)

        if device.type == "cuda":
            n = 200
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                layer(x, cache=dynamic)
            torch.cuda.synchronize()
            t_eager = (time.perf_counter() - t0) / n
            t0 = time.perf_counter()
            for _ in range(n):
                graph()
            torch.cuda.synchronize()
            t_graph = (time.perf_counter() - t0) / n
            print(f"  decode step, B={B}, hidden {D}: eager {t_eager * 1e6:.1f} us, CUDA graph {t_graph * 1e6:.1f} us "
                  f"({t_eager / t_graph:.1f}x)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="default: triton on CUDA, torch on CPU")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.backend = args.backend or ("triton" if device.type == "cuda" else "torch")
    dtype = getattr(torch, args.dtype)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'no capture'}), "
          f"backend {args.backend}, {args.dtype}")
    failures: list[str] = []
    op_pool(args, device, dtype, failures)
    op_state(args, device, dtype, failures)
    for kind in ("GatedDeltaNet", "KimiDeltaAttention"):
        layer_decode(args, device, dtype, failures, kind)
    print("ALL OK" if not failures else f"{len(failures)} MISMATCHES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
