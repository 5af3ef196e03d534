"""The nn.Module layers (GatedDeltaNet, KimiDeltaAttention) and their decoding cache.

- a full prefill equals a prefill of a prefix followed by token-by-token decoding with the cache;
- a padded batch with an attention mask (left padding as in generation, or right padding) gives
  the outputs and cache states of each sequence run alone, and decoding continues from them;
- the chunk and the recurrent kernels agree (outputs and gradients), and "auto" picks by length;
- a static cache is updated in place (fixed addresses for CUDA graphs) and equals the dynamic one.
"""
from __future__ import annotations

import pytest
import torch

from chunkwise.layers import GatedDeltaNet, KimiDeltaAttention, LinearAttentionCache
from helpers import DEVICE, INTERPRET, ON_GPU, rel_err

D = 32
TOL = 1e-5   # fp32 layer against fp32 layer: only the order of float operations differs


def make_layer(kind, seed=0, **kw):
    torch.manual_seed(seed)
    if kind == "gdn":
        layer = GatedDeltaNet(D, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, layer_idx=3, **kw)
    else:
        layer = KimiDeltaAttention(D, num_heads=2, head_dim=16, num_v_heads=4, layer_idx=3, **kw)
    with torch.no_grad():   # stronger gates than the init, so that decay matters over a few tokens
        layer.A_log.uniform_(-1.0, 0.5)
    return layer.to(DEVICE).eval()


def hidden(B, T, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


KINDS = ["gdn", "kda"]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_equals_prefix_then_decode(kind):
    layer = make_layer(kind, chunk_size=16)
    x = hidden(2, 37)
    with torch.no_grad():
        layer.mode = "chunk"
        y_full, cache_full = layer(x, use_cache=True)
        y_pre, cache = layer(x[:, :21], use_cache=True)
        layer.mode = "auto"
        steps = [y_pre]
        for t in range(21, 37):
            assert layer._form(1) == "recurrent"
            y_t, cache = layer(x[:, t:t + 1], cache=cache)
            steps.append(y_t)
    y_inc = torch.cat(steps, dim=1)
    assert rel_err(y_inc, y_full) < TOL
    s_full, s_inc = cache_full.get(3), cache.get(3)
    assert rel_err(s_inc.recurrent_state, s_full.recurrent_state) < TOL
    assert rel_err(s_inc.conv_state, s_full.conv_state) < TOL
    assert s_full.conv_state.shape == layer.state_shapes(2)[0]
    assert s_full.recurrent_state.shape == layer.state_shapes(2)[1]
    assert s_full.recurrent_state.dtype == torch.float32


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_equals_each_sequence_alone(kind, padding):
    layer = make_layer(kind, chunk_size=16, mode="chunk")
    lengths = [13, 2, 20]
    T = max(lengths)
    seqs = [hidden(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    x = torch.full((len(lengths), T, D), 7.0, device=DEVICE)    # junk in the padding: it must not leak
    mask = torch.zeros(len(lengths), T, dtype=torch.long, device=DEVICE)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        sl = slice(T - n, T) if padding == "left" else slice(0, n)
        x[i, sl], mask[i, sl] = s[0], 1
    nxt = hidden(len(lengths), 1, seed=99)
    with torch.no_grad():
        y, cache = layer(x, attention_mask=mask, use_cache=True)
        if padding == "left":   # generation: the mask grows by one column per token
            y_next, cache = layer(nxt, attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1), cache=cache)
        else:
            y_next, cache = layer(nxt, cache=cache)
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            y_alone, c_alone = layer(s, use_cache=True)
            y_next_alone, c_alone = layer(nxt[i:i + 1], cache=c_alone)
            sl = slice(T - n, T) if padding == "left" else slice(0, n)
            assert rel_err(y[i, sl], y_alone[0]) < TOL, f"row {i}"
            assert rel_err(y_next[i], y_next_alone[0]) < TOL, f"row {i} next token"
            got, want = cache.get(3), c_alone.get(3)
            assert rel_err(got.recurrent_state[i], want.recurrent_state[0]) < TOL
            assert rel_err(got.conv_state[i], want.conv_state[0]) < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_and_recurrent_kernels_agree(kind):
    layer = make_layer(kind, chunk_size=16).train()
    x = hidden(2, 29).requires_grad_(True)
    init = make_layer(kind, seed=5)
    cache0 = LinearAttentionCache()
    with torch.no_grad():   # a carried-in state from another prefix
        init(hidden(2, 9, seed=7), cache=cache0)
    results = {}
    for mode in ("chunk", "recurrent"):
        layer.mode = mode
        cache = LinearAttentionCache()
        cache.update(3, cache0.get(3).conv_state.clone(), cache0.get(3).recurrent_state.clone())
        y, cache = layer(x, cache=cache)
        loss = y.square().sum() + cache.get(3).recurrent_state.sum()
        grads = torch.autograd.grad(loss, [x, *layer.parameters()])
        results[mode] = (y.detach(), cache.get(3).recurrent_state.detach(), grads)
    (y_c, s_c, g_c), (y_r, s_r, g_r) = results["chunk"], results["recurrent"]
    assert rel_err(y_c, y_r) < TOL and rel_err(s_c, s_r) < TOL
    for a, b in zip(g_c, g_r):
        assert torch.isfinite(a).all() and a.abs().sum() > 0
        assert rel_err(a, b) < 1e-4


def test_auto_mode_picks_by_length():
    layer = make_layer("gdn", recurrent_max_len=8)
    assert [layer._form(T) for T in (1, 8, 9)] == ["recurrent", "recurrent", "chunk"]
    layer.train()
    assert layer._form(1) == "chunk"
    x = hidden(1, 8)
    with torch.no_grad():
        layer.eval()
        y_auto, _ = layer(x)
        layer.mode = "chunk"
        y_chunk, _ = layer(x)
    assert rel_err(y_auto, y_chunk) < TOL
    with pytest.raises(ValueError, match="mode"):
        GatedDeltaNet(D, mode="fast")


@pytest.mark.parametrize("kind", KINDS)
def test_static_cache_updates_in_place(kind):
    layer = make_layer(kind, chunk_size=16)
    x = hidden(3, 12)
    static = LinearAttentionCache.allocate([layer], 3, device=DEVICE)
    ptrs = [static.get(3).conv_state.data_ptr(), static.get(3).recurrent_state.data_ptr()]
    with torch.no_grad():
        y_s, _ = layer(x[:, :10], cache=static)
        y_d, dynamic = layer(x[:, :10], use_cache=True)
        for t in (10, 11):
            a, _ = layer(x[:, t:t + 1], cache=static)
            b, _ = layer(x[:, t:t + 1], cache=dynamic)
            assert rel_err(a, b) < TOL
    assert rel_err(y_s, y_d) < TOL
    assert ptrs == [static.get(3).conv_state.data_ptr(), static.get(3).recurrent_state.data_ptr()]
    assert rel_err(static.get(3).recurrent_state, dynamic.get(3).recurrent_state) < TOL
    static.reorder(torch.tensor([2, 0, 1], device=DEVICE))
    assert torch.equal(static.get(3).conv_state[0], dynamic.get(3).conv_state[2])
    static.reset()
    assert static.get(3).recurrent_state.abs().sum() == 0


def test_gdn_layer_matches_token_recurrence_float64():
    """The layer in float64 against the float64 token recurrence driven by the layer's own projections."""
    from chunkwise.api import l2norm
    from chunkwise.reference.recurrent import recurrent_forward
    import torch.nn.functional as F
    layer = make_layer("gdn", chunk_size=8, mode="chunk", backend="torch").double()
    x = hidden(2, 19).double()
    with torch.no_grad():
        y, _ = layer(x)
        q, k, v, z, b, a = layer._split(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        qkv, _ = layer.conv1d(torch.cat([q, k, v], -1))
        q, k, v = qkv.split([layer.key_dim, layer.key_dim, layer.value_dim], -1)
        q, k = l2norm(q.reshape(2, 19, 2, 16)), l2norm(k.reshape(2, 19, 2, 16))
        g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
        o, _ = recurrent_forward(q, k, v.reshape(2, 19, 4, 16), g, b.sigmoid(), 16 ** -0.5, dtype=torch.float64)
        want = layer.out_proj(layer.norm(o, z).reshape(2, 19, layer.value_dim))
    assert rel_err(y, want) < 1e-12


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", KINDS)
def test_decode_step_triton_backend(kind):
    """The decode step through the triton recurrent kernel (interpreter on CPU) equals the torch backend."""
    torch_layer = make_layer(kind, chunk_size=16, backend="torch")
    triton_layer = make_layer(kind, chunk_size=16, backend="torch")
    x = hidden(2, 6)
    with torch.no_grad():
        _, c1 = torch_layer(x[:, :5], use_cache=True)
        _, c2 = triton_layer(x[:, :5], use_cache=True)
        triton_layer.backend = "triton"
        y1, c1 = torch_layer(x[:, 5:], cache=c1)
        y2, c2 = triton_layer(x[:, 5:], cache=c2)
    assert rel_err(y2, y1) < TOL
    assert rel_err(c2.get(3).recurrent_state, c1.get(3).recurrent_state) < TOL


def test_cuda_graph_decode_example():
    """examples/cuda_graph_decode.py: on a GPU it captures the decode op and the layers' decode steps in
    CUDA graphs and checks replay == eager; on the CPU it runs the same static-buffer flow without capture."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import cuda_graph_decode
    argv = ["--device", DEVICE, "--hidden", "64", "--head-dim", "16", "--steps", "3", "--prompt", "20"]
    assert cuda_graph_decode.main(argv) == 0
