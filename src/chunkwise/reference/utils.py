"""Small helpers shared by the two PyTorch forms (no Triton here)."""
from __future__ import annotations

import torch


def expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, HV, D]: value head h reads q/k head h // (HV // H)."""
    H = x.shape[2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=2)


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None):
    """Yield (batch row, start, end) for each of the N sequences."""
    if cu_seqlens is None:
        for b in range(B):
            yield b, 0, T
    else:
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            yield 0, start, end


def varlen_pad_index(cu_seqlens: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int, int]:
    """Where each packed token goes in a zero-padded batch [N, T_pad].

    Returns (flat destination index [T_total] into N * T_pad, N, T_pad), with T_pad the longest
    sequence rounded up to ``multiple``.
    """
    cu = cu_seqlens.to("cpu", torch.long)
    lengths = cu[1:] - cu[:-1]
    N = lengths.numel()
    longest = int(lengths.max()) if N else 0
    T_pad = max(multiple, -(-longest // multiple) * multiple)
    seq_of_token = torch.repeat_interleave(torch.arange(N), lengths)
    pos_in_seq = torch.arange(int(cu[-1])) - cu[:-1][seq_of_token]
    return (seq_of_token * T_pad + pos_in_seq).to(cu_seqlens.device), N, T_pad


def pad_varlen(x: torch.Tensor | None, index: torch.Tensor, N: int, T_pad: int) -> torch.Tensor | None:
    """Packed [1, T_total, ...] -> zero-padded [N, T_pad, ...] (differentiable)."""
    if x is None:
        return None
    flat = x.new_zeros(N * T_pad, *x.shape[2:])
    flat = flat.index_copy(0, index, x[0])
    return flat.view(N, T_pad, *x.shape[2:])


def unpad_varlen(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Zero-padded [N, T_pad, ...] -> packed [1, T_total, ...]."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, index)[None]
