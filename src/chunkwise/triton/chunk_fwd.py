"""Transitional: the names the backward (chunk_bwd.py) and its tests still import from the forward's old module.
The forward lives in chunk.py, stage1.py, stage2.py (helpers in common.py, plans in configs.py); this file goes once
nothing imports it."""
from __future__ import annotations

from .chunk import chunk_fwd, saves_stage1  # noqa: F401
from .common import (BC, BT, FAST_EXP, G_FLOOR, SPAN_MAX, _INTERPRET, _alloc, _by_block, _chunk_span,  # noqa: F401
                     _dim, _ensure_allocator, _exp, _exp_or, _gate_kind, _mm, _mm_acc, _num_sms, _overlap, _poison,
                     _row_of, _rn_tf32, _side_stream, _signal_ready, _torch_scratch, _wait_ready, cdiv, chunk_slots,
                     chunks_whole, cut_state, next_pow2, on_tensor_device, pad_last, pad_state, padded_dims,
                     state_dtype)
from .configs import WIDE_16BIT_K, fp16_kda_in_fp32, wu_lowp_ok  # noqa: F401
from .stage1 import chunk_p, chunk_prepare, chunk_prepare_bwd  # noqa: F401


def saves_r() -> bool:
    """A saving forward always keeps R (chunk.saved_shapes)."""
    return True


def saves_final_state(g, beta) -> bool:
    """A saving forward keeps DeltaNet's final state (chunk.saved_shapes)."""
    return beta is not None and g is None
