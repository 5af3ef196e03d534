"""nn.Module layers over the chunkwise ops, with a decoding cache.

    GatedDeltaNet        Qwen3-Next / Qwen3.5's linear-attention layer (weights load from transformers)
    KimiDeltaAttention   Kimi Linear's KDA layer (per-channel gate)
    LinearAttentionCache per-layer conv state [B, D, W − 1] and recurrent state [B, HV, K, V]
    ShortConvolution, RMSNorm, GatedRMSNorm   the building blocks
"""
from .cache import LayerState, LinearAttentionCache
from .conv import ShortConvolution
from .gated_deltanet import GatedDeltaNet
from .kda import KimiDeltaAttention
from .norm import GatedRMSNorm, RMSNorm

__all__ = ["GatedDeltaNet", "KimiDeltaAttention", "LinearAttentionCache", "LayerState", "ShortConvolution",
           "RMSNorm", "GatedRMSNorm"]
