"""Serving with a state pool: prefill into the pool, verify draft tokens and roll back, reuse a prefix checkpoint.

An inference server keeps every request's recurrent state in a pool [P, HV, K, V] and names rows by
``state_indices`` (vLLM's name; -1 is a padding slot). The ops used here, for Gated DeltaNet:

1. prefill:  chunk_gated_delta_rule(..., initial_state=pool, state_indices=rows, has_initial_state=new,
             checkpoint_every=64, checkpoints=buf)      each prompt starts from its row (or zero), its final
             state lands in the row, and the state after every 64 tokens in buf (prefix cache)
2. verify:   fused_recurrent_gated_delta_rule(..., initial_state=pool, state_indices=rows,
             intermediate_states=drafts)                the state after each draft token; the pool is untouched
   accept:   chunkwise.rollback(pool, rows, drafts, num_accepted_tokens)
3. reuse:    a new request sharing a prompt's first 128 tokens copies that checkpoint into its row and
             prefills only the rest

Each step is checked against the plain ops (initial_state in, final state out). On a GPU the prefill and
the verify + accept steps are also captured in CUDA graphs and replayed.

    python examples/serving.py                 # CUDA if present (triton backend), else the CPU
    python examples/serving.py --device cpu
Exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import sys

import torch

import chunkwise

H, HV, K, V = 2, 4, 32, 32


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tokens(T, device, seed):
    """Random GDN inputs for T packed tokens: q, k (unit norm), v, g (log decay), beta."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.1 * torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta)]


def check(name, err, tol=1e-4):
    print(f"{name:<58} rel err {err:.1e}")
    if not err < tol:
        sys.exit(f"{name}: mismatch")


@torch.no_grad()
def main(device=None):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pool = torch.zeros(8, HV, K, V, device=device)
    lens = [150, 70, 130]
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu_cpu.to(device)
    rows = torch.tensor([5, 2, 7], device=device)
    prompt = tokens(int(cu_cpu[-1]), device, seed=0)

    # 1. prefill a batch of new requests into the pool, with a checkpoint every 64 tokens
    slots = chunkwise.checkpoint_slots(cu_cpu, 64)                    # [0, 2, 3, 5]: first slot per prompt
    ckpt = torch.empty(int(slots[-1]), HV, K, V, device=device)
    new = torch.zeros(3, dtype=torch.bool, device=device)             # all new: start from zero
    o, _ = chunkwise.chunk_gated_delta_rule(*prompt, initial_state=pool, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                            state_indices=rows, has_initial_state=new, checkpoint_every=64,
                                            checkpoints=ckpt)
    o_ref, h_ref = chunkwise.chunk_gated_delta_rule(*prompt, output_final_state=True, cu_seqlens=cu)
    check("prefill into the pool: outputs", rel_err(o, o_ref))
    check("prefill into the pool: pool rows = final states", rel_err(pool[rows], h_ref))

    # 2. speculative decoding: 3 draft tokens per request, verified from the pool without changing it
    draft = [x.reshape(3, 3, *x.shape[2:]) for x in tokens(9, device, seed=1)]     # [N=3, T=3, ...]
    inter = torch.empty(3, 3, HV, K, V, device=device)
    before = pool.clone()
    chunkwise.fused_recurrent_gated_delta_rule(*draft, initial_state=pool, state_indices=rows,
                                               intermediate_states=inter)
    check("verify: pool untouched", rel_err(pool, before), tol=1e-12)
    accepted = torch.tensor([0, 2, 3], device=device)                 # reject all, accept some, accept all
    chunkwise.rollback(pool, rows, inter, accepted)
    for n, a in enumerate(accepted.tolist()):
        want = before[rows[n]]
        if a:
            part = [x[n:n + 1, :a] for x in draft]
            _, h = chunkwise.fused_recurrent_gated_delta_rule(*part, initial_state=before[rows[n]][None],
                                                              output_final_state=True)
            want = h[0]
        check(f"rollback: request {n} keeps the state after {a} accepted", rel_err(pool[rows[n]], want))

    # 3. a new request shares prompt 0's first 128 tokens: start from that checkpoint, prefill the rest
    row = torch.tensor([0], device=device)
    pool[0] = ckpt[int(slots[0]) + 1]                                 # the state after 128 tokens
    rest = [x[:, 128:150] for x in prompt]
    o_rest, _ = chunkwise.chunk_gated_delta_rule(*rest, initial_state=pool, state_indices=row)
    check("prefix reuse: outputs = the whole prompt's", rel_err(o_rest, o_ref[:, 128:150]))
    check("prefix reuse: final state = the whole prompt's", rel_err(pool[0], h_ref[0]))

    if device.type == "cuda":
        graphs(device, prompt, cu, cu_cpu, rows, draft)


def graphs(device, prompt, cu, cu_cpu, rows, draft):
    """The prefill (its checkpoints stored by the forward kernel) and verify + accept in CUDA graphs:
    no host sync, fixed addresses; replay equals eager."""
    chunk_indices = chunkwise.prepare_chunk_indices(cu_cpu).to(device)    # planned once, outside the graph
    pool = torch.randn(8, HV, K, V, device=device)
    ckpt = torch.zeros(int(chunkwise.checkpoint_slots(cu_cpu, 64)[-1]), HV, K, V, device=device)
    inter = torch.empty(3, 3, HV, K, V, device=device)
    accepted = torch.tensor([1, 0, 3], device=device)

    def step():
        o, _ = chunkwise.chunk_gated_delta_rule(*prompt, initial_state=pool, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                                chunk_indices=chunk_indices, state_indices=rows, checkpoint_every=64,
                                                checkpoints=ckpt)
        chunkwise.fused_recurrent_gated_delta_rule(*draft, initial_state=pool, state_indices=rows,
                                                   intermediate_states=inter)
        chunkwise.rollback(pool, rows, inter, accepted)
        return o

    start = pool.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                     # compile the kernels before capture
        o_eager = step()
    torch.cuda.current_stream().wait_stream(side)
    eager, ckpt_eager = pool.clone(), ckpt.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = step()
    pool.copy_(start)
    ckpt.zero_()
    graph.replay()
    torch.cuda.synchronize()
    check("CUDA graph: prefill + verify + accept outputs", rel_err(o_graph, o_eager))
    check("CUDA graph: pool", rel_err(pool, eager))
    check("CUDA graph: prefix checkpoints", rel_err(ckpt, ckpt_eager))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    main(parser.parse_args().device)
