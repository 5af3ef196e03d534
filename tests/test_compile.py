"""torch.compile and torch.library: every op core is a custom op with a fake implementation and
registered autograd (chunkwise._custom_ops), so that

- torch.library.opcheck passes for each op (schema, fake tensors, autograd registration, AOT dispatch);
- torch.compile(fullgraph=True) over a function or model calling the public ops traces with no
  graph break, and gives the eager outputs and gradients.
"""
from __future__ import annotations

import pytest
import torch

import chunkwise
from chunkwise import _custom_ops
from helpers import CHUNK_OPS, DEVICE, FAMILIES, INTERPRET, ON_GPU, RECURRENT_OPS, make_inputs, reference, rel_err

FAMS = list(FAMILIES)


def _op_args(inp, scale, output_final_state=True, transpose=False, chunk_size=16, backend="torch"):
    h0 = inp.h0
    if h0 is not None and transpose:
        h0 = h0.transpose(-1, -2).contiguous()
    return (inp.q, inp.k, inp.v, inp.g, inp.beta, scale, h0, output_final_state, inp.cu_seqlens, None,
            transpose, chunk_size, backend)


CASES = {
    # name: (family, make_inputs kwargs, output_final_state, transpose_state_layout)
    "gdn": ("gdn", dict(B=2, T=20, H=1, HV=2), True, False),
    "kda-transposed": ("kda", dict(B=1, T=18, H=2), True, True),
    "delta-varlen": ("delta", dict(lengths=[5, 1, 12]), True, False),
    "gla-nostate": ("gla", dict(B=2, T=9, h0=False), False, False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_opcheck_forward(case, form):
    fam, kw, final, transpose = CASES[case]
    inp = make_inputs(fam, K=8, V=8, dtype=torch.float32, requires_grad=True, **kw)
    op = _custom_ops.chunk_fwd if form == "chunk" else _custom_ops.recurrent_fwd
    torch.library.opcheck(op, _op_args(inp, 8 ** -0.5, final, transpose))


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_opcheck_backward(form):
    inp = make_inputs("gdn", B=2, T=11, H=1, HV=2, K=8, V=8)
    do = torch.randn_like(inp.v)
    dht = torch.randn_like(inp.h0)
    op = _custom_ops.chunk_bwd if form == "chunk" else _custom_ops.recurrent_bwd
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.3, inp.h0, None, None, False, 16, "torch", do, dht,
            [True, True, True, True, True, True])
    torch.library.opcheck(op, args)
    # a gradient that is not asked for comes back empty
    grads = op(*args[:-1], [True, False, True, False, True, False])
    assert [x.numel() > 0 for x in grads] == [True, False, True, False, True, False]


def test_opcheck_pool():
    inp = make_inputs("gdn", B=3, T=1, H=2, K=8, V=8)
    pool = torch.randn(5, 2, 8, 8, device=DEVICE)
    idx = torch.tensor([4, -1, 0], device=DEVICE)
    torch.library.opcheck(_custom_ops.recurrent_pool_fwd,
                          (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.3, pool, idx, None, False, 64, "torch", None, None))


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_opcheck_triton(form):
    """The triton backend behind the same ops (interpreter on CPU: schema, fake tensors, autograd
    registration; the AOT test, which runs forward and backward several times, is left to the torch backend)."""
    inp = make_inputs("gdn", B=1, T=20 if form == "chunk" else 3, H=1, HV=2, K=16, V=16, requires_grad=True)
    op = _custom_ops.chunk_fwd if form == "chunk" else _custom_ops.recurrent_fwd
    torch.library.opcheck(op, _op_args(inp, 0.25, True, False, backend="triton"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    bwd = _custom_ops.chunk_bwd if form == "chunk" else _custom_ops.recurrent_bwd
    do, dht = torch.randn_like(inp.v), torch.randn_like(inp.h0)
    torch.library.opcheck(bwd, (inp.q.detach(), inp.k.detach(), inp.v.detach(), inp.g.detach(), inp.beta.detach(),
                                0.25, inp.h0.detach(), None, None, False, 16, "triton", do, dht, [True] * 6),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("fam,dtype", [("gdn", torch.float32), ("kda", torch.float16), ("delta", torch.float32)],
                         ids=["gdn-f32", "kda-f16", "delta-f32"])
@pytest.mark.parametrize("K", [16, 18], ids=["K16", "K18-padded"])
def test_opcheck_triton_saved_stage1(K, fam, dtype):
    """The op that saves stage 1 for the backward (the default under autograd; K = 18 is padded, so it saves
    nothing there): schema, fake tensors (each with the real output's shape and dtype), autograd registration;
    its backward's schema and fake tensors."""
    inp = make_inputs(fam, B=1, T=20, H=1, HV=2, K=K, V=16, dtype=dtype, requires_grad=True)
    args = _op_args(inp, 0.25, True, False, backend="triton")
    torch.library.opcheck(_custom_ops.chunk_fwd_saved, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    stage1 = _custom_ops.chunk_fwd_saved(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))[2:]
    fake = _custom_ops._stage1_shapes(inp.q, inp.v, inp.g, inp.beta, None)
    assert [(tuple(x.shape), x.dtype) for x in stage1] == [(tuple(s), d) for s, d in fake]
    # (fp16 KDA on the GPU saves nothing: its backward runs in fp32 there)
    saves = K == 16 and not (fam == "kda" and dtype == torch.float16 and inp.q.is_cuda)
    assert any(x.numel() > 0 for x in stage1) == saves
    do, dht = torch.randn_like(inp.v), torch.randn_like(inp.h0)
    torch.library.opcheck(_custom_ops.chunk_bwd_saved,
                          (inp.q.detach(), inp.k.detach(), inp.v.detach(), None if inp.g is None else inp.g.detach(),
                           inp.beta.detach(), 0.25, inp.h0.detach(), None, None, False, 16, "triton", *stage1, do, dht,
                           [True] * 6),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
# (triton 3.6's interpreter multiplies bf16 operands of tl.dot as their bit patterns, triton-lang/triton#11584: the
# values are meaningless there and overflow numpy's products; this test compares shapes and dtypes only)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fam", ["delta", "gdn", "kda"])
def test_saved_stage1_fake_matches_real_bf16_k128(fam):
    """At bf16 and K = 128 (where the saved T may be bf16) the saving forward's fake outputs (what torch.compile
    traces with) have the real outputs' shapes and dtypes, each of them."""
    inp = make_inputs(fam, B=1, T=20, H=1, HV=1, K=128, V=16, dtype=torch.bfloat16)
    args = _op_args(inp, 0.25, True, False, backend="triton")
    real = _custom_ops.chunk_fwd_saved(*args)
    fake = _custom_ops._stage1_shapes(inp.q, inp.v, inp.g, inp.beta, None)
    assert [(tuple(x.shape), x.dtype) for x in real[2:]] == [(tuple(s), d) for s, d in fake]
    assert real[5].numel() and real[5].dtype in (torch.bfloat16, torch.float32)     # T


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
def test_saved_split_fake_matches_real(no_floor):
    """Where the saving forward runs split (one varlen sequence far longer than an SM's share; the split's floor on
    the batch's chunks, a matter of host time, set to 0 for this small batch), it also keeps its segments' entering
    states and transitions (hs, mm); their fake shapes, sized from the shapes alone, are the real ones, and the
    backward op's fake outputs are its real ones."""
    inp = make_inputs("gdn", H=1, HV=2, K=16, V=16, lengths=[1100, 30], seed=2)
    args = _op_args(inp, 0.25, True, False, backend="triton")
    stage1 = _custom_ops.chunk_fwd_saved(*args)[2:]
    fake = _custom_ops._stage1_shapes(inp.q, inp.v, inp.g, inp.beta, inp.cu_seqlens)
    assert [(tuple(x.shape), x.dtype) for x in stage1] == [(tuple(s), d) for s, d in fake]
    hs, mm = stage1[4], stage1[5]
    assert hs.shape[0] == mm.shape[0] > 2 and hs.shape[1:] == (2, 16, 16) and mm.shape[1:] == (2, 16, 16)
    do, dht = torch.randn_like(inp.v), torch.randn_like(inp.h0)
    torch.library.opcheck(_custom_ops.chunk_bwd_saved,
                          (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.25, inp.h0, inp.cu_seqlens, None, False, 16,
                           "triton", *stage1, do, dht, [True] * 6),
                          test_utils=("test_schema", "test_faketensor"))


def _grads(out, tensors):
    o, ht = out
    w = torch.randn_like(o)
    loss = (o * w).sum() + (0 if ht is None else ht.square().sum())
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_compile_fullgraph_public_ops(fam, form):
    """torch.compile(fullgraph=True) over each public op (with the in-op preludes): no graph
    break, outputs and gradients equal eager, and both equal the float64 recurrence."""
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    inp = make_inputs(fam, B=2, T=19, H=1, HV=2, K=16, V=16, dtype=torch.float32, requires_grad=True)

    def f(*args):
        return op(*args, initial_state=inp.h0, output_final_state=True, chunk_size=8, backend="auto")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(0)
    eager = f(*inp.args())
    g_eager = _grads(eager, inp.tensors())
    torch.manual_seed(0)
    comp = compiled(*inp.args())
    g_comp = _grads(comp, inp.tensors())
    o_ref, h_ref = reference(inp)
    assert rel_err(eager[0], o_ref) < 2e-5 and rel_err(eager[1], h_ref) < 2e-5
    assert rel_err(comp[0], eager[0]) < 1e-6 and rel_err(comp[1], eager[1]) < 1e-6
    for a, b in zip(g_comp, g_eager):
        assert rel_err(a, b) < 1e-6


def test_compile_varlen_and_gate_in_kernel():
    """Varlen under compile: cu_seqlens values are not read on the host while tracing (shapes only)."""
    inp = make_inputs("kda", lengths=[7, 1, 13], H=2, K=16, V=16, requires_grad=True)
    a = torch.randn(1, 21, 2, 16, device=DEVICE, requires_grad=True)
    A_log = torch.randn(2, device=DEVICE, requires_grad=True)
    dt_bias = torch.randn(32, device=DEVICE, requires_grad=True)

    def f(q, k, v, a, beta, A_log, dt_bias, h0, cu):
        return chunkwise.chunk_kda(q, k, v, a, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                   dt_bias=dt_bias, chunk_size=8, backend="auto")

    args = (inp.q, inp.k, inp.v, a, inp.beta, A_log, dt_bias, inp.h0, inp.cu_seqlens)
    tensors = [inp.q, inp.k, inp.v, a, inp.beta, A_log, dt_bias, inp.h0]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager, comp = f(*args), compiled(*args)
    torch.manual_seed(1)
    g_eager = _grads(eager, tensors)
    torch.manual_seed(1)
    g_comp = _grads(comp, tensors)
    assert rel_err(comp[0], eager[0]) < 1e-6 and rel_err(comp[1], eager[1]) < 1e-6
    for x, y in zip(g_comp, g_eager):
        assert rel_err(x, y) < 1e-6


def test_gradients_match_float64_recurrence():
    """The registered autograd (recompute of the torch chunk form) gives the float64 recurrence's gradients."""
    inp = make_inputs("kda", B=2, T=21, H=2, K=8, V=8, dtype=torch.float64, requires_grad=True)
    out = chunkwise.chunk_kda(*inp.args(), initial_state=inp.h0, output_final_state=True, chunk_size=8,
                              backend="torch")
    torch.manual_seed(2)
    got = _grads(out, inp.tensors())
    from chunkwise.reference.recurrent import recurrent_forward
    ref = recurrent_forward(inp.q, inp.k, inp.v, inp.g, inp.beta, 8 ** -0.5, inp.h0, dtype=torch.float64)
    torch.manual_seed(2)
    want = _grads(ref, inp.tensors())
    for x, y in zip(got, want):
        assert rel_err(x, y) < 1e-10


def test_compile_inductor_model():
    """A small model (projections + the GDN op + norm) under the default inductor backend, fullgraph,
    forward and backward."""
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self, d=32, H=2, K=16):
            super().__init__()
            self.H, self.K = H, K
            self.proj = torch.nn.Linear(d, 3 * H * K + 2 * H)
            self.out = torch.nn.Linear(H * K, d)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v, a, b = self.proj(x).split([self.H * self.K] * 3 + [self.H] * 2, dim=-1)
            q, k, v = (t.reshape(B, T, self.H, self.K) for t in (q, k, v))
            g = -torch.nn.functional.softplus(a)
            o, _ = chunkwise.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True,
                                                    use_beta_sigmoid_in_kernel=True, chunk_size=8, backend="auto")
            return self.out(o.reshape(B, T, -1))

    model = Tiny().to(DEVICE)
    x = torch.randn(2, 24, 32, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    y_eager = model(x)
    gw_eager = torch.autograd.grad(y_eager.square().sum(), list(model.parameters()))
    y = compiled(x)
    gw = torch.autograd.grad(y.square().sum(), list(model.parameters()))
    assert rel_err(y, y_eager) < 1e-5
    for a, b in zip(gw, gw_eager):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_compile_fullgraph_layers(kind):
    """The nn.Module layers under torch.compile(fullgraph=True): a padded training batch (forward and
    backward) and a decode step that reads and updates a static cache in place."""
    from chunkwise.layers import GatedDeltaNet, KimiDeltaAttention, LinearAttentionCache
    torch.manual_seed(0)
    if kind == "gdn":
        layer = GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, chunk_size=8,
                              backend="auto")
    else:
        layer = KimiDeltaAttention(32, num_heads=2, head_dim=16, chunk_size=8, backend="auto")
    layer = layer.to(DEVICE)
    x = torch.randn(2, 13, 32, device=DEVICE)
    mask = torch.ones(2, 13, dtype=torch.long, device=DEVICE)
    mask[1, :4] = 0

    def train_step(x, mask):
        return layer(x, attention_mask=mask)[0]

    torch._dynamo.reset()
    compiled = torch.compile(train_step, fullgraph=True, backend="aot_eager")
    y_eager, y_comp = train_step(x, mask), compiled(x, mask)
    g_eager = torch.autograd.grad(y_eager.square().sum(), list(layer.parameters()))
    g_comp = torch.autograd.grad(y_comp.square().sum(), list(layer.parameters()))
    assert rel_err(y_comp, y_eager) < 1e-6
    for a, b in zip(g_comp, g_eager):
        assert rel_err(a, b) < 1e-5

    layer.eval()
    static = LinearAttentionCache.allocate([layer], 2, device=DEVICE)
    dynamic = LinearAttentionCache()
    with torch.no_grad():
        layer(x, cache=static)
        layer(x, cache=dynamic)

        def decode(t):
            return layer(t, cache=static)[0]

        step = torch.compile(decode, fullgraph=True, backend="aot_eager")
        for i in range(3):
            t = torch.randn(2, 1, 32, device=DEVICE)
            y_step = step(t)
            y_ref, dynamic = layer(t, cache=dynamic)
            assert rel_err(y_step, y_ref) < 1e-6
    assert rel_err(static.get(0).recurrent_state, dynamic.get(0).recurrent_state) < 1e-6
    assert rel_err(static.get(0).conv_state, dynamic.get(0).conv_state) < 1e-6


def test_compile_fullgraph_state_pool_decode():
    """The in-place state-pool decode (a mutating custom op) under torch.compile(fullgraph=True)."""
    inp = make_inputs("gdn", B=3, T=1, H=2, HV=4, K=16, V=16, h0=False)
    pool = torch.randn(6, 4, 16, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 2], device=DEVICE)

    def step(q, k, v, g, beta, pool, slots):
        return chunkwise.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=slots,
                                                          use_qk_l2norm_in_kernel=True, backend="auto")[0]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    pool_eager, pool_before = pool.clone(), pool.clone()
    o_comp = compiled(inp.q, inp.k, inp.v, inp.g, inp.beta, pool, slots)
    o_eager = step(inp.q, inp.k, inp.v, inp.g, inp.beta, pool_eager, slots)
    assert rel_err(o_comp, o_eager) < 1e-6 and rel_err(pool, pool_eager) < 1e-6
    assert o_comp[1].abs().sum() == 0                                     # the padding slot
    untouched = [0, 1, 3, 4]
    assert torch.equal(pool[untouched], pool_before[untouched])          # only the live slots were written
    assert rel_err(pool[5], pool_before[5]) > 1e-3 and rel_err(pool[2], pool_before[2]) > 1e-3


@pytest.mark.parametrize("form", ["chunk", "recurrent", "pool"])
def test_eager_fast_path_equals_the_custom_op(form, monkeypatch):
    """Plain eager calls without gradients skip the custom op's dispatch (_custom_ops._eager_plain) and give
    bit-identically what the custom op gives; a fake-tensor trace and inputs wanting gradients still go
    through the op (its fake implementation and its registered autograd)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inp = make_inputs("gdn", B=2, T=9 if form != "pool" else 1, H=1, HV=2, K=16, V=8, device="cpu")
    fn = chunkwise.chunk_gated_delta_rule if form == "chunk" else chunkwise.fused_recurrent_gated_delta_rule
    if form == "pool":
        pool = torch.randn(5, 2, 16, 8)
        kw = dict(initial_state=pool, state_indices=torch.tensor([3, 0]))
        mk = lambda: dict(kw, initial_state=pool.clone())  # noqa: E731
    else:
        mk = lambda: dict(initial_state=inp.h0)  # noqa: E731
    calls = {"op": 0}
    real = {name: getattr(_custom_ops, name) for name in ("chunk_fwd", "recurrent_fwd", "recurrent_pool_fwd")}
    for name, op in real.items():
        monkeypatch.setattr(_custom_ops, name, lambda *a, _op=op: (calls.__setitem__("op", calls["op"] + 1), _op(*a))[1])
    fast = fn(*inp.args(), output_final_state=True, backend="torch", **mk())
    assert calls["op"] == 0, "the eager call went through the custom op"
    monkeypatch.setattr(_custom_ops, "_eager_plain", lambda *t: False)
    slow = fn(*inp.args(), output_final_state=True, backend="torch", **mk())
    assert calls["op"] == 1
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    monkeypatch.undo()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:                # the op's fake implementation
        fake_args = [mode.from_tensor(x) for x in inp.args()]
        o, _ = fn(*fake_args, output_final_state=True, backend="torch",
                  **{k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in mk().items()})
        assert o.shape == inp.v.shape
    q = inp.q.clone().requires_grad_(True)                                  # autograd: through the op
    o, _ = fn(q, *inp.args()[1:], output_final_state=True, backend="torch", **mk())
    if form != "pool":
        o.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()
