"""chunkwise: chunkwise-parallel linear attention (Gated DeltaNet, KDA, DeltaNet, simple GLA / Mamba2 SSD)."""
from .api import prepare_chunk_indices
from .mamba2 import mamba_chunk_scan_combined
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
    "prepare_chunk_indices",
    "mamba_chunk_scan_combined",
]
