"""Static check of the Triton kernels' software pipelines for Hopper, without a GPU: every launch of a fwd+bwd is
compiled for sm_90 (benchmarks/tools.py's stand-in driver, PTX only: the pipelines are decided in the TTGIR) and each pipelined loop of its TTGIR is searched for
a shared-memory copy into a buffer that an unwaited async wgmma may still read (the training forward and backward,
the inference forward, one-token decode).

The hazard (triton 3.6, triton #6691 / PR #7110): a loaded tile that feeds both an async `warp_group_dot` and a
register load (`ttg.local_load`, e.g. for an elementwise product) gets the register use's buffer count, one too few
for the product; the loop's copy of a later iteration then lands in the slot an in-flight product reads. On the H200
this made the backward's ⟨S, dS'⟩ tiles race (GDN's gradients changed from run to run).

For each loop body (walked twice, for the back edge) the check tracks the async products in flight and the buffers
(`ttg.local_alloc`, through `memdesc_index` / `memdesc_trans` views) they read; `warp_group_dot_wait {pendings = N}`
leaves the N latest in flight. A copy (`async_copy_global_to_local`, `local_store`) into a buffer with both a register
use and an in-flight product is a hazard. Buffers read only by products are the pipeliner's own business (it gives
them the extra slot).

    python tests/sm90_hazards.py --fams gdn,kda,delta,gla --dtypes bfloat16,float16,float32 \\
        --shapes k128,grouped_varlen,k64,k256
Exit status 1 if a hazard is found; one line per kernel specialisation checked with -v.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

_VAL = r"%[\w#]+"


def loop_bodies(ttgir: str) -> list[list[str]]:
    """The op lines of each scf.for body (nested regions included), by brace depth."""
    out, stack = [], []       # stack: per open region, the body list of its scf.for or None
    for ln in ttgir.splitlines():
        s = ln.strip()
        closes, opens = s.startswith("}"), s.endswith("{")
        if closes and stack:
            body = stack.pop()
            if body is not None:
                out.append(body)
        for body in stack:
            if body is not None and not closes:
                body.append(s)
        if opens:
            stack.append([] if re.search(r"\bscf\.for\b", s) and not closes else None)
    return out


def hazards(ttgir: str) -> list[str]:
    allocs = set(re.findall(rf"({_VAL}) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<\d+x", ttgir))
    view = {}
    for m in re.finditer(rf"({_VAL}) = ttg\.memdesc_(?:index|trans|subslice|reinterpret) ({_VAL})", ttgir):
        view[m.group(1)] = m.group(2)

    def root(v):
        seen = 0
        while v in view and seen < 64:
            v, seen = view[v], seen + 1
        return v if v in allocs else None

    reg_use = {root(m.group(1)) for m in re.finditer(rf"ttg\.local_load ({_VAL})", ttgir)} - {None}
    found = []
    for body in loop_bodies(ttgir):
        flight: list[set] = []          # per in-flight async product, the buffers it reads
        for _ in range(2):
            for op in body:
                if "ttng.warp_group_dot " in op and "isAsync = true" in op:
                    args = re.search(r"warp_group_dot ([^{:]*)", op).group(1)
                    flight.append({root(v) for v in re.findall(_VAL, args)} - {None})
                elif "ttng.warp_group_dot_wait" in op:
                    n = int(re.search(r"pendings = (\d+)", op).group(1))
                    flight = flight[len(flight) - n:] if n else []
                elif "ttng.warp_group_dot " in op:          # a synchronous product waits for every earlier one
                    flight = []
                m = re.search(rf"(?:ttg\.async_copy_global_to_local {_VAL}, ({_VAL})|ttg\.local_store {_VAL}, ({_VAL}))",
                              op)
                if m:
                    buf = root(m.group(1) or m.group(2))
                    if buf in reg_use and any(buf in f for f in flight):
                        found.append(f"copy into {buf} (also register-loaded) under an unwaited product")
    return sorted(set(found))


# head layouts checked (--shapes): K = V = 128 at 32 heads; grouped value heads (HV = 2 H) with varlen and a carried-in
# state; K = V = 64; K = 256, V = 128 (16-bit inputs there run in fp32)
SHAPES = {"k128": dict(H=32, HV=32, K=128, V=128, varlen=False),
          "grouped_varlen": dict(H=8, HV=16, K=128, V=128, varlen=True),
          "k64": dict(H=32, HV=32, K=64, V=64, varlen=False),
          "k256": dict(H=8, HV=8, K=256, V=128, varlen=False)}


def _run_family(chunkwise, fam, dt, T, s):
    """One family's inference forward, training forward + backward and one-token decode at head layout s."""
    import torch
    H, HV, K, V = s["H"], s["HV"], s["K"], s["V"]
    q = torch.randn(1, T, H, K, dtype=dt, requires_grad=True)
    k = torch.randn(1, T, H, K, dtype=dt, requires_grad=True)
    v = torch.randn(1, T, HV, V, dtype=dt, requires_grad=True)
    beta = torch.rand(1, T, HV, dtype=dt, requires_grad=True)
    g = (-torch.rand(1, T, HV, *((K,) if fam == "kda" else ()))).requires_grad_(True)
    kw = dict(backend="triton")
    if s["varlen"]:
        kw.update(cu_seqlens=torch.tensor([0, 1, T // 3, T], dtype=torch.int32),
                  initial_state=torch.randn(3, HV, K, V), output_final_state=True)
    run = {"gdn": lambda: chunkwise.chunk_gated_delta_rule(q, k, v, g, beta, **kw),
           "kda": lambda: chunkwise.chunk_kda(q, k, v, g, beta, **kw),
           "delta": lambda: chunkwise.chunk_delta_rule(q, k, v, beta, **kw),
           "gla": lambda: chunkwise.chunk_simple_gla(q, k, v, g, **kw)}[fam]
    with torch.no_grad():       # the inference forward (its own stage-1 forms)
        run()
    o, _ = run()
    o.backward(torch.randn_like(o))
    rec = {"gdn": chunkwise.fused_recurrent_gated_delta_rule, "kda": chunkwise.fused_recurrent_kda,
           "delta": chunkwise.fused_recurrent_delta_rule, "gla": chunkwise.fused_recurrent_simple_gla}[fam]
    with torch.no_grad():       # decode: one token per sequence, a batch of 4
        one = [t.detach()[:, :4].transpose(0, 1).contiguous() if t is not None else None
               for t in (q, k, v, g if fam != "delta" else None, beta if fam != "gla" else None)]
        rec(*[t for t in one if t is not None], backend="triton")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fams", default="gdn,kda,delta,gla")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--shapes", default="k128", help="head layouts: " + ", ".join(SHAPES))
    ap.add_argument("-v", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    os.environ.pop("TRITON_INTERPRET", None)
    import tools
    tools.install_sm90(ptx_only=True)
    import torch
    from triton.runtime.jit import JITFunction
    import chunkwise

    launch, checked, bad = JITFunction.run, {}, []

    def check(self, *args, grid, warmup, **kw):
        k = launch(self, *args, grid=grid, warmup=True, **kw)
        key = (self.fn.__name__, tuple(sorted((n, v) for n, v in kw.items() if isinstance(v, (bool, int, str)))))
        if key not in checked:
            checked[key] = hazards(k.asm["ttgir"])
            if checked[key]:
                bad.append((key, checked[key]))
            if a.v:
                print(f"{self.fn.__name__:28s} {'HAZARD ' + '; '.join(checked[key]) if checked[key] else 'ok'}")
        return k

    JITFunction.run = check
    for dt in (getattr(torch, d) for d in a.dtypes.split(",")):
        for fam in a.fams.split(","):
            for shape in a.shapes.split(","):
                _run_family(chunkwise, fam, dt, a.T, SHAPES[shape])
    for key, why in bad:
        print(f"HAZARD {key[0]} {dict(key[1])}: {'; '.join(why)}")
    print(f"pipeline_check: {len(checked)} kernel specialisations, {len(bad)} with a hazard")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
