"""chunkwise: chunkwise-parallel linear attention (Gated DeltaNet, KDA, DeltaNet, simple GLA / Mamba2 SSD)."""
from . import _custom_ops  # noqa: F401  (registers the torch.ops.chunkwise.* custom ops)
from . import hf  # noqa: F401  (transformers drop-ins: chunkwise.hf.use_chunkwise)
from .utils import prepare_chunk_indices
from .layers import GatedDeltaNet, KimiDeltaAttention, LinearAttentionCache
from .mamba2 import mamba_chunk_scan_combined
from .prefill import checkpoint_slots
from .speculative import rollback
from .ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_simple_gla,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    fused_recurrent_simple_gla,
)

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
    "chunk_kda", "fused_recurrent_kda",
    "chunk_delta_rule", "fused_recurrent_delta_rule",
    "chunk_simple_gla", "fused_recurrent_simple_gla",
    "prepare_chunk_indices", "checkpoint_slots",
    "mamba_chunk_scan_combined", "rollback",
    "GatedDeltaNet", "KimiDeltaAttention", "LinearAttentionCache",
]
