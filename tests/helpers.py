"""Shared test machinery: random inputs per family, the float64 ground truth, error measures.

DEVICE is "cuda" on the GPU (real sizes, bf16) and "cpu" in CI (interpreter, small shapes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import chunkwise
from chunkwise.api import DELTA, GDN, GLA, KDA, gate_from_projections  # noqa: F401
from chunkwise.reference.recurrent import recurrent_forward
from chunkwise.reference.utils import expand_heads
from chunkwise.triton.common import builds_for_gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the GPU tests' sizes: on a GPU, and where kernels are built for one from CPU tensors without running (benchmarks/
# tools.py warm fills Triton's cache off the device)
ON_GPU = torch.cuda.is_available() or builds_for_gpu(torch.device("cpu"))

# head dims whose sm_90 tiles neither the real-size tests (K = V = 128) nor the small-tile ones (K <= 64) build: K = 128
# with narrow values (the saving forward's stage 1 at V <= 32 raised an illegal memory access on the H200),
# padded K and V, narrow keys with wide values. Each pair is a build of its own on the GPU, while the interpreter runs
# one path for all, so the tests over this grid run on the GPU only (skip_unless_sm90_builds).
HEAD_DIM_GRID = [(64, 16), (64, 100), (100, 32), (128, 16), (128, 48), (128, 100), (32, 128), (16, 64)]
skip_unless_sm90_builds = pytest.mark.skipif(not ON_GPU, reason="the sm_90 build of each tile size is what this "
                                                                 "checks (the interpreter runs one path for all)")

FAMILIES = {"gdn": GDN, "kda": KDA, "delta": DELTA, "gla": GLA}
CHUNK_OPS = {"gdn": chunkwise.chunk_gated_delta_rule, "kda": chunkwise.chunk_kda,
             "delta": chunkwise.chunk_delta_rule, "gla": chunkwise.chunk_simple_gla}
RECURRENT_OPS = {"gdn": chunkwise.fused_recurrent_gated_delta_rule, "kda": chunkwise.fused_recurrent_kda,
                 "delta": chunkwise.fused_recurrent_delta_rule, "gla": chunkwise.fused_recurrent_simple_gla}


@dataclass
class Inputs:
    fam: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor | None
    h0: torch.Tensor | None
    cu_seqlens: torch.Tensor | None

    def args(self):
        """Positional arguments of the family's public op (before scale)."""
        a = [self.q, self.k, self.v]
        if self.g is not None:
            a.append(self.g)
        if self.beta is not None:
            a.append(self.beta)
        return a

    def tensors(self):
        return [x for x in (self.q, self.k, self.v, self.g, self.beta, self.h0) if x is not None]


def make_inputs(fam: str, B=2, T=100, H=2, HV=None, K=32, V=32, dtype=torch.float32, device=DEVICE,
                gate="normal", h0=True, lengths=None, seed=0, requires_grad=False) -> Inputs:
    """Random, never-zero inputs. k is L2-normalised (as the models do) so the delta rule is stable.

    gate: "normal" (log-decay in [-0.5, 0)), "zero" (g = 0), "strong" (very negative, with a hard
    reset g = -1e4 at one token and chunks whose gates sum below -100).
    lengths: sequence lengths for a varlen batch (then B is ignored and B = 1).
    """
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H
    if lengths is not None:
        B, T = 1, int(sum(lengths))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        N = len(lengths)
    else:
        cu, N = None, B

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, HV, V)
    spec = FAMILIES[fam]
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05 if spec.delta else None
    g = None
    if spec.gate != "none":
        shape = (B, T, HV) if spec.gate == "scalar" else (B, T, HV, K)
        if gate == "zero":
            g = torch.zeros(shape, dtype=torch.float64)
        else:
            g = -torch.rand(*shape, generator=gen, dtype=torch.float64) * 0.5 - 1e-3
            if gate == "strong":
                g = g * 8                                   # chunks of 64 sum to about -130
                g[:, T // 3] = -1e4                          # a hard reset
    state = rnd(N, HV, K, V) * 0.5 if h0 else None
    cast = dict(device=device)
    q, k, v = (x.to(dtype=dtype, **cast) for x in (q, k, v))
    g = None if g is None else g.to(dtype=torch.float32 if dtype != torch.float64 else dtype, **cast)
    beta = None if beta is None else beta.to(dtype=dtype, **cast)
    state = None if state is None else state.to(dtype=torch.float32 if dtype != torch.float64 else dtype, **cast)
    if cu is not None:
        cu = cu.to(device)
    if requires_grad:
        for x in (q, k, v, g, beta, state):
            if x is not None:
                x.requires_grad_(True)
    return Inputs(fam, q, k, v, g, beta, state, cu)


def reference(inp: Inputs, scale=None):
    """The float64 token recurrence, on the inputs' device (on the GPU the CPU recurrence at real size took
    minutes per test with a dozen test workers sharing the cores): (o, final_state)."""
    K = inp.q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    d = lambda x: None if x is None else x.detach()  # noqa: E731
    return recurrent_forward(d(inp.q), d(inp.k), d(inp.v), d(inp.g), d(inp.beta), scale,
                             d(inp.h0), d(inp.cu_seqlens), dtype=torch.float64)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# the error a dtype may cost against the float64 recurrence (docs/design.md §3; bf16/fp16 at fla's level)
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


# --------------------------------------------------------------------------------------------
# random shapes for the Triton ops' property tests (hypothesis)
# --------------------------------------------------------------------------------------------

# on the GPU each head dim is another build: fewer examples, the head dims the other small-tile tests build
_PROP_K, _PROP_V, _PROP_N = ((16, 32, 64), (16, 32), 10) if ON_GPU else ((8, 16, 18, 24, 40, 64), (8, 10, 16, 48), 30)
PROPERTY_SETTINGS = settings(max_examples=_PROP_N, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def per_family(examples: int) -> settings:
    """PROPERTY_SETTINGS for a property test run once per family (pytest parameters, so that the families' builds go
    to different workers): ``examples`` in all, shared out among the four."""
    return settings(PROPERTY_SETTINGS, max_examples=max(1, -(-examples // len(FAMILIES))))


# (the family is each test's parameter)
PROPERTY_SHAPES = dict(
    H=st.integers(1, 2), group=st.integers(1, 3),
    K=st.sampled_from(_PROP_K), V=st.sampled_from(_PROP_V), batch=st.tuples(st.integers(1, 2), st.integers(1, 200)),
    lengths=st.lists(st.sampled_from([0, 1, 2, 63, 64, 65, 100]), min_size=1, max_size=4) | st.none(),
    gate=st.sampled_from(["normal", "zero", "strong"]), h0=st.booleans(), final=st.booleans(),
    transpose=st.booleans(), seed=st.integers(0, 2**16))


def property_inputs(fam, H, group, K, V, batch, lengths, gate, h0, seed) -> Inputs:
    """fp32 inputs for PROPERTY_SHAPES' draw: ``batch`` (B, T) unless ``lengths`` (a varlen batch; all-empty gets a
    1-token sequence). A hard reset (g = −1e4 at token T // 3) at a lone sequence's first token would make dh0 exactly
    0, which no relative error measures: there the gate stays normal."""
    if lengths is not None and sum(lengths) == 0:
        lengths = lengths + [1]
    B, T = (1, sum(lengths)) if lengths is not None else batch
    if gate == "strong" and T < 3:
        gate = "normal"
    return make_inputs(fam, B=B, T=T, H=H, HV=H * group, K=K, V=V, h0=h0, gate=gate, lengths=lengths, seed=seed)


def fla_ops():
    """fla's op modules (delta_rule, gated_delta_rule, kda, simple_gla), or None where fla is not installed. Their
    autotuners keep the first candidate that builds instead of timing each one: the tests compare errors, not speed,
    and the search took 100-200 s of a GPU run per comparison."""
    try:
        import fla.ops.delta_rule as fd
        import fla.ops.gated_delta_rule as fg
        import fla.ops.kda as fk
        import fla.ops.simple_gla as fs
    except ImportError:
        return None
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import common       # benchmarks/common.py: how the benchmarks find and steer fla's autotuners
    for at in common._fla_autotuners():
        at.do_bench = common._compile_only_bench
    return fd, fg, fk, fs


def fla_error(inp: Inputs):
    """fla's relative output error against the float64 recurrence on the same inputs (None where fla is not
    installed). fla's KDA, DeltaNet and simple GLA take q and k repeated to the value heads."""
    mods = fla_ops()
    if mods is None:
        return None
    fd, fg, fk, fs = mods
    HV = inp.v.shape[2]
    q, k = (inp.q, inp.k) if inp.fam == "gdn" else (expand_heads(inp.q, HV), expand_heads(inp.k, HV))
    kw = dict(initial_state=inp.h0, output_final_state=True, cu_seqlens=inp.cu_seqlens)
    with torch.no_grad():
        if inp.fam == "gdn":
            o, _ = fg.chunk_gated_delta_rule(q, k, inp.v, inp.g, inp.beta, **kw)
        elif inp.fam == "kda":
            o, _ = fk.chunk_kda(q, k, inp.v, inp.g, inp.beta, **kw)
        elif inp.fam == "delta":
            o, _ = fd.chunk_delta_rule(q, k, inp.v, inp.beta, **kw)
        else:
            o, _ = fs.chunk_simple_gla(q, k, inp.v, g=inp.g, **kw)
    return rel_err(o, reference(inp)[0])
