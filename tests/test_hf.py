"""Hugging Face transformers: drop-in functions and the per-model switch (chunkwise.hf).

A tiny randomly initialised Qwen3-Next (hidden 64, linear- and full-attention layers) gives the
same logits and token-for-token the same greedy generation with and without chunkwise.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging

import pytest
import torch

import chunkwise.hf as cwhf
from chunkwise import _custom_ops
from chunkwise.layers import GatedDeltaNet, LinearAttentionCache
from helpers import rel_err

# transformers is in the test extra (pip install -e ".[test]"): no skip when it is missing
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next


# transformers' functions as the modeling module holds them: wrapped in its fallback notice (or in fla's kernels)
_WRAPPED = {name: getattr(fn, "_chunkwise_original", fn) for name in ("torch_chunk_gated_delta_rule",
                                                                      "torch_recurrent_gated_delta_rule")
            for fn in [getattr(hf_qwen3_next, name)]}


def _original(name):
    fn = getattr(hf_qwen3_next, name)
    fn = getattr(fn, "_chunkwise_original", fn)      # if a dispatcher is installed
    return inspect.unwrap(fn)                        # transformers' pure torch function


@pytest.fixture(autouse=True)
def _transformers_torch_path(monkeypatch):
    """transformers routes its Gated DeltaNet functions to fla's kernels when fla is importable (the
    bench extra installs it), and those need a GPU: every comparison here is against transformers'
    own PyTorch code, so that is what its modules call during a test."""
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(hf_qwen3_next, name, _original(name))


@pytest.mark.parametrize("name", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_signatures_match_transformers(name):
    ours = inspect.signature(getattr(cwhf, name)).parameters
    theirs = inspect.signature(_original(name)).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == \
           [(p.name, p.kind, p.default) for p in theirs.values()]


def _theirs(name, q, k, v, *rest, **kw):
    """transformers' own function, with q and k repeated to v's heads as its Qwen3-Next layer does before calling it
    (some transformers releases take grouped heads there, others do not)."""
    group = v.shape[2] // q.shape[2]
    return _original(name)(q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2), v, *rest, **kw)


@pytest.mark.parametrize("name", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("with_state", [False, True])
def test_functions_match_transformers(name, with_state):
    gen = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 2, 75, 2, 4, 16, 8
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen) * 0.3
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen) if with_state else None
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, ht = getattr(cwhf, name)(q, k, v, g, beta, **kw)
    o_hf, ht_hf = _theirs(name, q, k, v, g, beta, **kw)
    assert o.dtype == o_hf.dtype and ht.dtype == ht_hf.dtype and ht.shape == ht_hf.shape
    assert rel_err(o, o_hf) < 1e-5 and rel_err(ht, ht_hf) < 1e-5
    o2, none = getattr(cwhf, name)(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, position_ids=None)
    assert none is None and rel_err(o2, getattr(cwhf, name)(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]) == 0


def tiny_qwen3_next(seed=0):
    config = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():   # the init draws A_log in [log .01, log 16]: keep, but make dt_bias random too
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.dt_bias.normal_()
    return model


class CountCalls:
    def __init__(self, monkeypatch):
        self.n = 0
        real = _custom_ops.forward

        def spy(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(_custom_ops, "forward", spy)


def test_qwen3_next_logits_and_greedy_generation(monkeypatch):
    model = tiny_qwen3_next()
    calls = CountCalls(monkeypatch)
    ids = torch.randint(2, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    prompt = ids[:, :9]
    with torch.no_grad():
        logits_hf = model(ids).logits
        tokens_hf = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert calls.n == 0
        with cwhf.use_chunkwise(model, backend="torch") as handle:
            assert len(handle.layers) == 3
            logits_cw = model(ids).logits
            n_prefill = calls.n
            tokens_cw = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert n_prefill == 3 and calls.n == 3 + 3 * 20     # 3 layers: prefill + 19 decode steps + prefill
        logits_back = model(ids).logits
    assert calls.n == 3 + 3 * 20                             # removed: transformers' own functions again
    assert rel_err(logits_cw, logits_hf) < 1e-5
    assert torch.equal(logits_back, logits_hf)
    assert tokens_cw.shape == (2, 29)
    assert torch.equal(tokens_cw, tokens_hf)


def test_use_chunkwise_prints_no_fallback_notice(monkeypatch):
    """transformers wraps its gated-delta-rule functions in a notice, printed once per process, that they are
    "falling back to its reference PyTorch implementation because flash-linear-attention is not installed". A
    switched-on model runs chunkwise's ops without entering those wrappers: no such notice. The same model
    switched off prints it (where fla is not installed)."""
    for name, fn in _WRAPPED.items():
        monkeypatch.setattr(hf_qwen3_next, name, fn)
    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        logging.Logger.warning_once.cache_clear()      # (once per process: forget any earlier test's)
        model = tiny_qwen3_next()
        calls = CountCalls(monkeypatch)
        prompt = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), cwhf.use_chunkwise(model, backend="torch"):
            model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        assert not [n for n in notices if "gated_delta_rule" in n], notices
        assert calls.n == 3 * 2                         # 3 layers: the prefill and one decode step
        if importlib.util.find_spec("fla") is None:
            with torch.no_grad():
                model(prompt)
            assert any("gated_delta_rule" in n and "flash-linear-attention" in n for n in notices), notices
    finally:
        hf_logger.removeHandler(handler)


def test_use_chunkwise_layer_class_defined_elsewhere(monkeypatch):
    """A layer class defined in another module that inherits transformers' forward (a fine-tuning library's
    subclass, say) calls the functions of the module where that forward is defined: those are routed."""
    class PatchedGatedDeltaNet(hf_qwen3_next.Qwen3NextGatedDeltaNet):     # (defined here, in the test module)
        pass

    model = tiny_qwen3_next()
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.__class__ = PatchedGatedDeltaNet
    calls = CountCalls(monkeypatch)
    with torch.no_grad(), cwhf.use_chunkwise(model, backend="torch") as handle:
        assert len(handle.layers) == 3
        model(torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(2)))
    assert calls.n == 3


def test_use_chunkwise_errors():
    with pytest.raises(ValueError, match="no transformers Gated DeltaNet"):
        cwhf.use_chunkwise(torch.nn.Linear(2, 2))
    model = tiny_qwen3_next()
    with pytest.raises(ValueError, match="backend"):
        cwhf.use_chunkwise(model, backend="cuda")
    handle = cwhf.use_chunkwise(model)
    with pytest.raises(ValueError, match="already"):
        cwhf.use_chunkwise(model)
    handle.remove()
    cwhf.use_chunkwise(model).remove()


def test_gated_deltanet_layer_loads_transformers_weights():
    """chunkwise.layers.GatedDeltaNet takes Qwen3NextGatedDeltaNet's state dict as it is and gives its
    outputs, for a prefill and for the decode steps after it."""
    model = tiny_qwen3_next(seed=3)
    hf_layer = model.model.layers[0].linear_attn
    layer = GatedDeltaNet(64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_size=4,
                          layer_idx=0, backend="torch").eval()
    layer.load_state_dict(hf_layer.state_dict())
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf_layer(x)
        got, cache = layer(x[:, :26], use_cache=True)
        steps = [got]
        for t in range(26, 30):
            y, cache = layer(x[:, t:t + 1], cache=cache)
            steps.append(y)
    assert isinstance(cache, LinearAttentionCache)
    assert rel_err(torch.cat(steps, 1), want) < 1e-5


def test_drop_in_packed_sequences_with_cu_seqlens():
    """transformers passes ``cu_seqlens`` through **kwargs for packed sequences (B = 1): each sequence
    then starts from its own state, as if run alone through transformers' function."""
    gen = torch.Generator().manual_seed(5)
    lengths, H, HV, K, V = [9, 1, 30], 2, 4, 16, 8
    T = sum(lengths)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g, beta = -torch.rand(1, T, HV, generator=gen) * 0.3, torch.rand(1, T, HV, generator=gen)
    cu = torch.tensor([0, 9, 10, 40], dtype=torch.int32)
    o, ht = cwhf.torch_chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                              cu_seqlens=cu)
    assert ht.shape == (3, HV, K, V)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, h_n = _theirs("torch_chunk_gated_delta_rule", q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel_err(o[:, s:e], o_n) < 1e-5 and rel_err(ht[n], h_n[0]) < 1e-5
