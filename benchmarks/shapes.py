"""The benchmarks' shapes, by name, and the inputs drawn for them.

    python benchmarks/shapes.py            # every set and shape

A shape is (B, T, H, HV, K, V, cu_seqlens): H query / key heads, HV value heads (HV > H: grouped heads), and for a
varlen batch B = 1 with T the total token count and the sequences' boundaries in ``cu_seqlens``. Names read as the
tests' ids: ``B4-T8192-H16-HV32`` (``-HV..`` only where HV != H, ``-K..`` only where K != 128).

Sets (``--shapes`` of every benchmark takes set names and shape names, comma separated):

- ``standing``: the shapes every GPU run times (one long sequence, a batch, grouped heads, varlen).
- ``few-heads``: the rows where the heads are too few to fill the GPU (2/8 heads at 8k-64k tokens, as a
  large model at tensor-parallel 8; 32/32 and 16/64 at 32k; 8/32 at 4 x 8k; a varlen batch with one long sequence).
- ``decode``: one token per sequence, batch 1 to 256, and a verify step of 4 draft tokens at batch 64 and 256
  (bench_decode.py).
- ``cp``: one sequence of 128k tokens, split over the GPUs of a context-parallel group (bench_cp.py).
- ``cpu``: the CPU benchmark's (fp32, bench_cpu.py).
- ``smoke``: tiny shapes for a CPU run of any benchmark (the interpreter or the torch backend; tests use them).
"""
from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    T: int
    H: int
    HV: int
    K: int = 128
    V: int = 128
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def tokens(self) -> int:
        return self.B * self.T

    @property
    def sequences(self) -> int:
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1


def dense(B: int, T: int, H: int, HV: int | None = None, K: int = 128, V: int = 128) -> Shape:
    HV = HV or H
    name = f"B{B}-T{T}-H{H}" + (f"-HV{HV}" if HV != H else "") + (f"-K{K}" if K != 128 else "") + \
        (f"-V{V}" if V != K else "")
    return Shape(name, B, T, H, HV, K, V)


def varlen(prefix: str, lengths: list[int], H: int, HV: int | None = None, K: int = 128, V: int = 128) -> Shape:
    HV = HV or H
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    name = f"{prefix}-T{cu[-1]}-H{H}" + (f"-HV{HV}" if HV != H else "") + (f"-K{K}" if K != 128 else "")
    return Shape(name, 1, cu[-1], H, HV, K, V, tuple(cu))


def random_lengths(n: int, total: int, seed: int = 0) -> list[int]:
    """``n`` lengths of random cuts of ``total`` tokens (the same on every machine: a seeded Python RNG)."""
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


_ALL = [
    # standing set
    dense(1, 32768, 32), dense(8, 4096, 32), dense(4, 8192, 16, 32),
    varlen("varlen16", random_lengths(16, 32768), 32),
    # few heads: a large model sharded over GPUs (2-8 value heads per GPU), and the many-heads rows beside them
    dense(1, 8192, 2, 8), dense(1, 32768, 2, 8), dense(1, 65536, 2, 8), dense(1, 32768, 16, 64), dense(4, 8192, 8, 32),
    varlen("varlen-long", [24576] + [512] * 16, 2, 8),     # one long sequence next to 16 short ones
    # context parallel
    dense(1, 131072, 32),
    # decode (T = 1); speculative decoding's verify step (T = 4 draft tokens per sequence)
    *[dense(B, 1, 32) for B in (1, 16, 64, 256)], dense(64, 4, 32), dense(256, 4, 32),
    # CPU
    dense(1, 4096, 16), dense(1, 1024, 16),
    # smoke: a partial chunk, grouped heads, K = 32, varlen with a one-token sequence; one decode step; a verify step
    dense(1, 130, 2, 4, 32, 32), varlen("varlen3", [70, 1, 59], 2, 4, 32, 32), dense(2, 1, 2, 4, 32, 32),
    dense(2, 4, 2, 4, 32, 32),      # a verify step
]
SHAPES: dict[str, Shape] = {s.name: s for s in _ALL}

SETS: dict[str, list[str]] = {
    "standing": ["B1-T32768-H32", "B8-T4096-H32", "B4-T8192-H16-HV32", "varlen16-T32768-H32"],
    "few-heads": ["B1-T8192-H2-HV8", "B1-T32768-H2-HV8", "B1-T65536-H2-HV8", "B1-T32768-H32", "B1-T32768-H16-HV64",
                  "B4-T8192-H8-HV32", "varlen-long-T32768-H2-HV8"],
    "cp": ["B1-T131072-H32"],
    "decode": ["B1-T1-H32", "B16-T1-H32", "B64-T1-H32", "B256-T1-H32", "B64-T4-H32", "B256-T4-H32"],
    "cpu": ["B1-T4096-H16", "B1-T1024-H16"],
    "smoke": ["B1-T130-H2-HV4-K32", "varlen3-T130-H2-HV4-K32", "B2-T1-H2-HV4-K32"],
}


def resolve(spec: str) -> list[Shape]:
    """The shapes named by ``spec``: set and shape names, comma separated, in order, each shape once."""
    names: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part in SETS:
            names += SETS[part]
        elif part in SHAPES:
            names.append(part)
        else:
            raise SystemExit(f"unknown shape or set {part!r}; sets: {', '.join(SETS)}; shapes: {', '.join(SHAPES)}")
    return [SHAPES[n] for n in dict.fromkeys(names)]


# the gate draws: fla's benchmarks' (about -0.08 per token for the scalar gate); KDA's per-channel gates likewise
GATE_SCALE = 0.1


def make_inputs(op: str, s: Shape, dtype: torch.dtype, device, gate_scale: float = GATE_SCALE, seed: int = 0) -> dict:
    """Random inputs of op ("gdn", "kda", "delta", "gla") at shape s: q, k (L2-normalised), v in ``dtype``; g (log
    decay, fp32: [B, T, HV] or KDA's [B, T, HV, K]) and beta as the op takes them, None otherwise; for varlen also
    cu_seqlens on the device, its CPU copy and the chunk index (no host sync in the timed call)."""
    gen = torch.Generator(device).manual_seed(seed)     # drawn where they are used: large shapes draw fast

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device)
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V
    x = dict(q=rnd(B, T, H, K).to(dtype), k=F.normalize(rnd(B, T, H, K), dim=-1).to(dtype),
             v=rnd(B, T, HV, V).to(dtype), g=None, beta=None)
    if op in ("gdn", "gla"):
        x["g"] = F.logsigmoid(rnd(B, T, HV)) * gate_scale
    elif op == "kda":
        x["g"] = F.logsigmoid(rnd(B, T, HV, K)) * gate_scale
    if op != "gla":
        x["beta"] = (torch.rand(B, T, HV, generator=gen, device=device) * 0.9 + 0.05).to(dtype)
    x["cu_seqlens"] = x["cu_seqlens_cpu"] = x["chunk_indices"] = None
    if s.cu_seqlens is not None:
        import chunkwise
        cu = torch.tensor(s.cu_seqlens, dtype=torch.int32)
        x.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu,
                 chunk_indices=chunkwise.prepare_chunk_indices(cu).to(device))
    return x


if __name__ == "__main__":
    for set_name, names in SETS.items():
        print(f"{set_name}:")
        for n in names:
            s = SHAPES[n]
            seqs = f", {s.sequences} sequences" if s.cu_seqlens else ""
            print(f"  {n:28s} B={s.B} T={s.T} H={s.H} HV={s.HV} K={s.K} V={s.V}{seqs}")
