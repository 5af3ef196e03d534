"""Transitional: the names the backward (chunk_bwd.py) and its tests still import from the forward's old module.
The forward lives in chunk.py, stage1.py, stage2.py (helpers in common.py, plans in configs.py); this file goes once
nothing imports it."""
from __future__ import annotations

import os

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


PRECISIONS = ("tf32", "tf32rn", "tf32x3", "ieee")


def prec_env(name: str, default: str) -> str:
    """A product precision from the environment variable ``name`` (one of PRECISIONS, see _mm)."""
    value = os.environ.get(name, default)
    if value not in PRECISIONS:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(PRECISIONS)}")
    return value


def reg_cap(name: str) -> dict:
    """Launch option capping a kernel's registers per thread (Triton's ``maxnreg``), from CHUNKWISE_MAXNREG
    ("prep:168,bwd_dv:168", or with "/" between items, or "all:168"; names as the backward's BWD_WARPS keys, plus "fwd_o" for stage 2
    and "prep_fwd" for the forward's stage 1): {} unless set. A variant for the sweeps: on the H200 (ncu,
    run of cd0d241) the chunk-parallel kernels ran at 255 registers and 4 warps, two programs (8 warps) per
    SM, a third of their issue slots used; a cap trades spills for more programs per SM."""
    for item in filter(None, os.environ.get("CHUNKWISE_MAXNREG", "").replace("/", ",").split(",")):
        key, val = item.split(":")
        if key == name or key == "all":
            return {"maxnreg": int(val)}
    return {}


def _env_choice(name: str, default: int, choices=range(2)) -> int:
    """A launch choice among the integers ``choices`` from the environment variable ``name`` (``default`` when
    unset); anything else is an error that names the variable."""
    allowed = [str(c) for c in choices]
    value = os.environ.get(name, str(default))
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected {', '.join(allowed[:-1])} or {allowed[-1]}")
    return int(value)


def _env_switch(name: str, default: int) -> bool:
    """A 0 / 1 launch choice from the environment variable ``name`` (``default`` when unset)."""
    return _env_choice(name, default) == 1
