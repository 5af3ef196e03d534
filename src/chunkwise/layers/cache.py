"""The decoding cache of the linear-attention layers: per layer, a conv state and a recurrent state."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerState:
    """conv_state: [B, D, W − 1] (the last W − 1 conv inputs, in the activations' dtype);
    recurrent_state: [B, HV, K, V] fp32 (the delta-rule state S)."""
    conv_state: torch.Tensor
    recurrent_state: torch.Tensor


class LinearAttentionCache:
    """Per-layer states for incremental decoding, keyed by the layers' ``layer_idx``.

    A dynamic cache (the default) stores each new state as it comes. A static cache
    (`LinearAttentionCache.allocate`) owns fixed buffers and updates them in place with ``copy_``,
    so that their addresses never change: what a CUDA graph of the decode step needs.

    Batch rows are sequences; `reorder` gathers rows (beam search), `reset` zeroes the states.
    """

    def __init__(self):
        self.layers: dict[int, LayerState] = {}
        self.static = False
        self.seen_tokens = 0

    @classmethod
    def allocate(cls, layers, batch_size: int, device=None, dtype: torch.dtype = torch.float32):
        """A static cache with zeroed buffers for ``layers`` (modules with ``layer_idx`` and
        ``state_shapes(batch_size)``): conv states in ``dtype``, recurrent states in fp32."""
        cache = cls()
        for layer in layers:
            conv_shape, rec_shape = layer.state_shapes(batch_size)
            cache.layers[layer.layer_idx] = LayerState(torch.zeros(conv_shape, device=device, dtype=dtype),
                                                       torch.zeros(rec_shape, device=device, dtype=torch.float32))
        cache.static = True
        return cache

    def __contains__(self, layer_idx: int) -> bool:
        return layer_idx in self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def get(self, layer_idx: int) -> LayerState | None:
        return self.layers.get(layer_idx)

    def update(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> LayerState:
        old = self.layers.get(layer_idx)
        if self.static and old is not None:
            with torch.no_grad():
                old.conv_state.copy_(conv_state)
                old.recurrent_state.copy_(recurrent_state)
            return old
        self.layers[layer_idx] = LayerState(conv_state, recurrent_state)
        return self.layers[layer_idx]

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Keep batch rows ``beam_idx`` (in place for a static cache)."""
        for state in self.layers.values():
            for name in ("conv_state", "recurrent_state"):
                x = getattr(state, name)
                picked = x.index_select(0, beam_idx.to(x.device))
                if self.static:
                    x.copy_(picked)
                else:
                    setattr(state, name, picked)

    def reset(self) -> None:
        for state in self.layers.values():
            state.conv_state.zero_()
            state.recurrent_state.zero_()
        self.seen_tokens = 0
