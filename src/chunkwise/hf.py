"""Hugging Face transformers: chunkwise in place of the PyTorch gated-delta-rule functions of
Qwen3-Next (and the models built like it: Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid, ...).

Two ways in:

1. Drop-in functions with exactly the signatures of transformers'
   ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule``
   (``transformers/models/qwen3_next/modeling_qwen3_next.py``)::

       from chunkwise.hf import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

2. An opt-in switch for one model::

       model = AutoModelForCausalLM.from_config(config)
       handle = chunkwise.hf.use_chunkwise(model)          # or: with chunkwise.hf.use_chunkwise(model): ...
       model.generate(...)
       handle.remove()                                     # back to transformers' own functions

   It finds the model's Gated DeltaNet layers. Where a layer calls the functions through its own
   attributes (``self.chunk_gated_delta_rule``, transformers 4.x) those attributes are replaced.
   Where it calls module-level functions (transformers 5.x), the modeling module's two functions
   are replaced once by a dispatcher that routes to chunkwise only while a switched-on layer runs,
   so other models in the process keep transformers' own code. transformers' wrappers of those
   functions are then never entered, so their notice that the gated delta rule "is falling back to its
   reference PyTorch implementation because flash-linear-attention is not installed" is not printed
   for a switched-on layer. Its notice about ``causal_conv1d`` is true and stays: the layer's short
   convolution is transformers' own, which chunkwise does not replace.

transformers is imported by neither: this module works with whatever version the model comes from.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import torch

from .ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

_FUNCTION_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_ATTRIBUTE_NAMES = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
                    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule"}


def _options(kwargs):
    """The keyword arguments transformers passes through ``**kwargs`` that chunkwise uses:
    ``cu_seqlens`` (packed sequences, B = 1) and ``backend``; the others (position ids, flash-attention
    bookkeeping, ...) do not concern the delta rule and are ignored, as transformers' functions do."""
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is None:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
    return cu_seqlens, kwargs.get("backend", _active_backend() or "auto")


def torch_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` on chunkwise's chunk op.

    query, key: [B, T, H, K]; value: [B, T, HV, V]; g: [B, T, HV] log-decay (≤ 0); beta: [B, T, HV];
    initial_state: None | [B, HV, K, V]. Output scale K^-½. Returns (o [B, T, HV, V] in query's dtype,
    final state [B, HV, K, V] fp32 or None). ``kwargs``: see `_options`. ``chunk_size`` is accepted for
    the signature and not used: chunkwise's result does not depend on it, and its CPU path is fastest at
    its own default (32).
    """
    cu_seqlens, backend = _options(kwargs)
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend)


def torch_recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_recurrent_gated_delta_rule`` (decode) on chunkwise's recurrent op.
    Same arguments and returns as `torch_chunk_gated_delta_rule`, without chunk_size."""
    cu_seqlens, backend = _options(kwargs)
    return fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend)


_OURS = {"torch_chunk_gated_delta_rule": torch_chunk_gated_delta_rule,
         "torch_recurrent_gated_delta_rule": torch_recurrent_gated_delta_rule}

# ----------------------------------------------------------------------------------------------
# the per-model switch
# ----------------------------------------------------------------------------------------------

_local = threading.local()          # .backend: set while a switched-on layer runs


def _active_backend():
    return getattr(_local, "backend", None)


def _dispatcher(name: str, original):
    ours = _OURS[name]

    def dispatch(*args, **kwargs):
        if _active_backend() is None:
            return original(*args, **kwargs)
        return ours(*args, **kwargs)

    dispatch.__name__ = name
    dispatch.__doc__ = f"chunkwise dispatcher: chunkwise inside layers switched on by use_chunkwise, else {name}."
    dispatch._chunkwise_original = original
    return dispatch


def _install_dispatchers(module) -> bool:
    """Replace the modeling module's two functions by dispatchers (once). False if it has none."""
    if not all(hasattr(module, n) for n in _FUNCTION_NAMES):
        return False
    for name in _FUNCTION_NAMES:
        fn = getattr(module, name)
        if not hasattr(fn, "_chunkwise_original"):
            setattr(module, name, _dispatcher(name, fn))
    return True


def _forward_module(layer):
    """The module whose functions the layer's forward calls: where that forward is defined (a subclass
    that inherits it from another model's class calls that model's functions), else the class's own."""
    for name in (getattr(type(layer).forward, "__module__", None), type(layer).__module__):
        module = sys.modules.get(name) if name else None
        if module is not None and all(hasattr(module, n) for n in _FUNCTION_NAMES):
            return module
    return sys.modules[type(layer).__module__]


class ChunkwiseHandle:
    """What `use_chunkwise` returns: ``remove()`` (or leaving the ``with`` block) switches back."""

    def __init__(self, layers, backend):
        self.layers = layers
        self.backend = backend

    def remove(self):
        for layer in self.layers:
            saved = layer.__dict__.pop("_chunkwise_saved", {})
            for attr, value in saved.items():
                if value is None:
                    layer.__dict__.pop(attr, None)
                else:
                    setattr(layer, attr, value)
        self.layers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


@contextmanager
def _backend_scope(backend):
    before = _active_backend()
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = before


def _switch_forward(layer, backend):
    forward = layer.forward

    def chunkwise_forward(*args, **kwargs):
        with _backend_scope(backend):
            return forward(*args, **kwargs)

    return chunkwise_forward


def use_chunkwise(model: torch.nn.Module, backend: str = "auto") -> ChunkwiseHandle:
    """Make a transformers Qwen3-Next-like model run its Gated DeltaNet layers on chunkwise.

    Args:
        model: any nn.Module holding Gated DeltaNet layers of transformers (Qwen3-Next, Qwen3.5, ...).
        backend: "auto" (triton on CUDA tensors, torch otherwise), "torch" or "triton".
    Returns:
        a `ChunkwiseHandle`; ``handle.remove()`` restores the model (also usable as a context manager).
    Raises:
        ValueError if the model has no such layer.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    switched = []
    for module in model.modules():
        if "_chunkwise_saved" in module.__dict__:
            raise ValueError(f"{type(module).__name__} is already switched to chunkwise")
        saved = {}
        if all(hasattr(module, a) and callable(getattr(module, a)) for a in _ATTRIBUTE_NAMES) and \
                "GatedDeltaNet" in type(module).__name__:
            # transformers 4.x: the layer calls self.chunk_gated_delta_rule / self.recurrent_gated_delta_rule
            for attr, name in _ATTRIBUTE_NAMES.items():
                saved[attr] = module.__dict__.get(attr)
                setattr(module, attr, _with_backend(_OURS[name], backend))
        elif "GatedDeltaNet" in type(module).__name__ and _install_dispatchers(_forward_module(module)):
            # transformers 5.x: module-level functions, routed by the dispatcher while this layer runs
            saved["forward"] = module.__dict__.get("forward")
            module.forward = _switch_forward(module, backend)
        if saved:
            module._chunkwise_saved = saved
            switched.append(module)
    if not switched:
        raise ValueError(f"{type(model).__name__} has no transformers Gated DeltaNet layer to switch to chunkwise")
    return ChunkwiseHandle(switched, backend)


def _with_backend(fn, backend):
    def call(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return fn(*args, **kwargs)
    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call
