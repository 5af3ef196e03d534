"""The launch plans of the chunk kernels, as data: which form each stage takes and how it is launched, per GPU
architecture, family (gate kind), input dtype and head-dim bucket.

sm_90 (H100 / H200) holds the measured values; any other architecture takes the same values for now, except where
a value needs sm_90 (tensor descriptors, TMA). Each default carries one line of why; the figures behind them are in
docs/performance.md. Sweeps and tests change a plan with ``dataclasses.replace`` and pass it to the launcher
(``chunk_fwd(..., plan=...)``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace

import torch

from .common import BT, _dim, builds_for_gpu, cdiv, target_arch

# 16-bit inputs with K above this run the chunk forward and backward in fp32 (inputs upcast, outputs and gradients
# returned in the input dtype): at K = 256 the sm_90 builds with 16-bit inputs raised illegal memory accesses or
# gave wrong gradients, where fp32 passed.
WIDE_16BIT_K = 128

_16BIT = (torch.bfloat16, torch.float16)


def wu_lowp_ok(dtype: torch.dtype, K: int, V: int) -> bool:
    """Whether stage 1 (the forward's, or the backward's recompute) may form W / U with 16-bit product operands:
    16-bit inputs at a 128-wide key tile and a value tile of at least 64 only (narrower tiles' 16-bit builds raised
    illegal memory accesses or gave wrong gradients on sm_90 with triton 3.6)."""
    return dtype != torch.float32 and _dim(K) == 128 and _dim(V) >= 64


def fp16_kda_in_fp32(q, g) -> bool:
    """Whether chunk_bwd runs these inputs in fp32 and the forward saves nothing for it: fp16 with a per-channel gate,
    built for a GPU (its sm_90 fp16 build gave inf gradients on small varlen batches with grouped heads, where the
    interpreter and fp32 were right)."""
    return q.dtype == torch.float16 and g is not None and g.dim() == 4 and builds_for_gpu(q.device)


def precisions(dtype: torch.dtype, gate: int = 0) -> tuple[str, str, str]:
    """(input-dtype dots, fp32 factor products, the solve), as _mm names them.

    fp32 inputs: tf32x3 everywhere, ~fp32 accuracy on the tensor cores ("ieee" lowers 64×64 products to FMA loops
    that take minutes to compile and spill). 16-bit inputs: tf32, except the solve for fp16 and KDA's per-channel
    products for fp16 (tf32x3): the tensor cores truncate fp32 operands toward zero (triton#4574), a bias that does
    not average out over the 128-channel sums and that bf16's own rounding hides."""
    if dtype == torch.float32:
        return "tf32x3", "tf32x3", "tf32x3"
    if dtype == torch.float16:
        return "tf32", "tf32x3" if gate == 2 else "tf32", "tf32x3"
    return "tf32", "tf32", "tf32"


@dataclass(frozen=True)
class ForwardPlan:
    """How chunk_fwd runs one call. Fields left None are picked per call from the shapes (``resolve_stage2``)."""
    # product precisions (see precisions); solve_prec "fp16": where T comes out non-finite, the solve again at
    # redo_prec, in a second launch over the flagged programs (redo_split) or inside the first
    dot_prec: str
    mm_prec: str
    solve_prec: str
    redo_prec: str
    redo_split: bool
    # stage 1 (the delta families)
    t_form: bool                  # stage 1 writes T diag(β) instead of W, U; stage 2 forms R = T diag(β)(V − e^G ⊙ K S)
    p_in: bool | None             # P from stage 1 (simple GLA: from chunk_p); None: simple GLA picks by occupancy
    wu_lowp: bool                 # W, U products from 16-bit operands
    ap_lowp: int                  # KDA's one-reference A from bf16 operands
    prep_warps: int
    prep_bkc: int                 # KDA's column chunk (channels per step of stage 1's loop)
    prep_stages: int
    prep_maxnreg: int | None
    # stage 2
    num_warps: int = 4
    bv: int | None = None         # value block; None: _pick_bv
    num_stages: int | None = None  # None: _pick_stages
    trans: bool = False           # the transposed step (Sᵀ as the products' register operand) where bv >= 64
    trans_stages: int | None = None  # the transposed step's depth where less than _pick_stages's
    tma: bool = False             # the serial loop's tiles through tensor descriptors
    tma_o: bool = False           # its output stores too (not with segments, not where R is stored)
    overlap: int = 0              # stage 2 beside stage 1: 0 off, 1 at the plan's bv / depth, 2 at bv 64, 2 stages
    segments: int | None = None   # simple GLA: segments per sequence; None: picked where the grid leaves SMs idle
    seg_phase1: tuple | None = None  # (bv, num_warps, num_stages) of the segments' first pass
    seg_sub: int | None = None    # sub-segments per segment of that pass
    # the delta families' sequence split (triton/split.py): chunks per segment, 0 none; None: split_chunks picks
    delta_split: int | None = None
    split_pass: tuple | None = None  # (bv, num_warps, num_stages) of its segment pass; None: split_launch's
    combine: tuple | None = None  # (bv, num_warps, num_stages) of its serial combine; None: combine_launch's


# the plan fields that are tile sizes (Triton's tiles are powers of 2), and those holding one first in a tuple
_BLOCK_FIELDS = ("bv", "prep_bkc", "dqk_bk", "wy_bk", "pair_bk")
_BLOCK_FIRST = ("seg_phase1", "split_pass", "combine")


def check_plan(plan) -> None:
    """A plan given by the caller: every block size a power of 2, else a ValueError naming the field (the kernels
    would fail to compile with an error far from its cause)."""
    for f in fields(plan):
        val = getattr(plan, f.name)
        if f.name in _BLOCK_FIRST and val is not None:
            val = val[0]
        elif f.name not in _BLOCK_FIELDS:
            continue
        if val is not None and (val <= 0 or val & (val - 1)):
            raise ValueError(f"{type(plan).__name__}.{f.name} = {getattr(plan, f.name)}: block sizes must be "
                             f"powers of 2")


def forward_plan(device: torch.device, dtype: torch.dtype, gate: int, delta: bool, K: int, V: int,
                 save: bool = False) -> ForwardPlan:
    """The default plan of a forward on ``device`` (its target_arch) with inputs of ``dtype`` (after the 16-bit
    K > WIDE_16BIT_K upcast), gate kind ``gate``, delta rule or not (simple GLA), head dims K, V (as the kernels
    run them), ``save``: stage 1 kept for the backward."""
    return _forward_plan(target_arch(device) or 90, dtype, gate, delta, K, V, save)


@functools.lru_cache(maxsize=None)
def _forward_plan(arch: int, dtype: torch.dtype, gate: int, delta: bool, K: int, V: int, save: bool) -> ForwardPlan:
    wide16 = dtype in _16BIT
    dot, mm, solve = precisions(dtype, gate)
    # T diag(β) instead of W, U: one fewer product pair and K + V fewer values per token written. Saving for the
    # backward only for KDA (its stage 1 loses a column loop); not fp16 KDA (inf gradients at small tiles on sm_90)
    t_form = delta and ((gate == 2 and dtype != torch.float16) if save else True)
    # the inference solve from fp16 operands (11-bit significand, at the 16-bit rate) for bf16 inputs; KDA redoes a
    # non-finite T inside (its first launch is already a flagging one), the others in a second launch so that the
    # first is built without the redo (no spills at its register cap)
    fp16_solve = delta and t_form and not save and dtype == torch.bfloat16
    return ForwardPlan(
        dot_prec=dot, mm_prec=mm, solve_prec="fp16" if fp16_solve else solve, redo_prec=solve,
        redo_split=fp16_solve and gate != 2,
        t_form=t_form,
        # DeltaNet forms P in stage 2 (stage 1 then reads no q); GDN's decay mask on the serial path costs more
        # than stage 1 saves; simple GLA decides by occupancy
        p_in=(save or gate != 0) if delta else None,
        # W, U from 16-bit operands (as fla does) where those builds are right; KDA keeps tf32 (a 10x larger error)
        wu_lowp=delta and gate != 2 and wu_lowp_ok(dtype, K, V),
        ap_lowp=int(delta and gate == 2 and t_form and not save and dtype == torch.bfloat16),
        prep_warps=4,
        prep_bkc=32 if gate == 2 else 64,       # 32 channels: KDA's fastest within fla's error
        # only KDA's stage 1 has a loop to pipeline (its column chunks)
        prep_stages=3 if gate == 2 and dtype == torch.bfloat16 and K <= 128 else 1,
        # GDN's inference stage 1 at 168 registers: three programs per SM instead of two, for a few bytes of spills
        prep_maxnreg=168 if delta and gate == 1 and t_form and wide16 and K <= 128 else None,
        num_warps=4,
        # the delta rule's transposed step keeps the state in registers as the products' first operand; simple GLA
        # is faster plain
        trans=delta,
        trans_stages=2 if delta and gate in (0, 1) else None,   # 2 stages beat 3 for GDN / DeltaNet transposed
        tma=arch >= 90,                 # one copy instruction per tile instead of per-thread addresses and masks
        tma_o=arch >= 90,
        # stage 2 beside stage 1 for 16-bit GDN (at its own block) and KDA (at bv 64, 2 stages, where that grid
        # takes at most half the SMs); DeltaNet was slower beside at every block and depth tried
        overlap={0: 0, 1: 1, 2: 2}[gate] if delta and wide16 else 0,
    )


SEG_MIN_CHUNKS = 16   # simple GLA's segments: at least this many chunks each (the split's overhead, once per segment)
SEG_P1_BV = 128       # simple GLA's split: the value block of its first pass (local end states), at 4 warps, 3 stages


def _pick_bv(V: int, K: int, programs: int) -> int:
    """Value block of stage 2: 64 while that still gives >= 128 programs (about one per SM), else 32 (K > 128: 32)."""
    bv = 64 if K <= 128 else 32
    if bv == 64 and programs * cdiv(V, 64) < 128:
        bv = 32
    return min(bv, _dim(V))


def _pick_stages(elt: int, BK: int, bv: int, delta: bool, p_in: bool, busy: bool, t_tile: bool = False,
                 trans: bool = False) -> int:
    """Pipeline depth of stage 2: up to 3 while the tiles of one chunk, times the depth, stay under ~200 KB of the
    SM's 227 KB of shared memory. ``busy`` (at least two programs per SM): the deepest of 2-3 stages at which two
    programs share an SM, where one exists. ``t_tile``: a [C, C] tile more (KDA's T_FORM), with 212 KB for the tiles
    (216 KB with ``trans``, which stages nothing on the state's chain), so that KDA keeps 3 stages."""
    per_stage = elt * (BT * BK * (3 if delta else 2) + (BT * BT if p_in else 0) + (BT * BT if t_tile else 0) + BT * bv)
    if busy and 2 * 2 * per_stage <= 200 * 1024:
        return min(3, (100 * 1024) // per_stage)
    return max(1, min(3, ((216 if t_tile and trans else 212 if t_tile else 200) * 1024) // per_stage))


def _pick_segments(NT: int, programs: int, n_sm: int) -> int:
    """Segments per sequence for simple GLA's split (a power of two, at most 16): the most that still fit the grid in
    one wave of two programs per SM, each segment at least SEG_MIN_CHUNKS chunks long."""
    nseg = 1
    while programs * nseg * 2 <= 2 * n_sm and nseg < 16 and cdiv(NT, nseg * 2) >= SEG_MIN_CHUNKS:
        nseg *= 2
    return nseg


# The delta families' split (triton/split.py): segments of whole chunks, each sequence's run side by side. Its extra
# work: the segment pass, a state-only walk (3 of stage 2's 5 products a chunk) over K + V columns instead of V for
# every segment but the last, and one [K, K] × [K, V] product per segment in the serial combine; it pays where the
# unsplit stage 2 leaves SMs idle. Estimates until measured (docs/performance.md).
SPLIT_FILL = 1          # programs per SM the split's stage 2 aims at: one wave (at K = 128 its pipelined tiles take
                        # most of an SM's shared memory, so a second program per SM would run in a second wave)
SPLIT_MIN_CHUNKS = 16   # chunks a segment has at least (each segment costs a program start and a combine step)
SPLIT_IDLE = 4          # dense: a split only where the unsplit grid takes at most 1 / SPLIT_IDLE of the SMs (on a
                        # grid of about one program per SM it adds a state pass, not parallelism: performance.md)
SPLIT_BUSY = 4          # varlen: none where the unsplit grid holds SPLIT_BUSY programs per SM (throughput-bound: a
                        # long sequence costs about its share, and every sequence's state makes two more trips)
SPLIT_MAX_SEGS = 32     # dense: segments per sequence at most (the combine's serial chain)
SPLIT_MIN_SEQ = 256     # chunks a sequence has at least to split (varlen: the batch in all): below it the split's
                        # two more launches cost an eager call more host time than they save on the GPU


def split_chunks(plan: ForwardPlan, N: int, T: int, HV: int, K: int, V: int, varlen: bool, chunks: int,
                 n_sm: int) -> int:
    """Chunks per segment of the delta families' sequence split for N sequences (T tokens each, or T in all with
    varlen, ``chunks`` chunks in all) of HV value heads at head dims K, V on n_sm SMs; 0: no split.

    Dense, where the unsplit grid (64-wide value blocks) takes at most 1 / SPLIT_IDLE of the SMs and each sequence
    has at least SPLIT_MIN_SEQ chunks: the most segments per sequence (a power of two) at which stage 2's grid still
    fits one wave of SPLIT_FILL programs per SM, each segment at least SPLIT_MIN_CHUNKS long. Varlen (the lengths
    are not read on the host), where the unsplit grid holds fewer than SPLIT_BUSY programs per SM and the batch at
    least SPLIT_MIN_SEQ chunks in all: segments of the chunks one program would walk were all chunks spread evenly
    over SPLIT_FILL programs per SM; a sequence longer than that splits, the others stay whole. Key dims over 128
    (fp32 inputs only) take no split (the combine holds a [K, K] tile)."""
    if plan.delta_split is not None:
        return plan.delta_split
    if _dim(K) > 128:
        return 0
    nvb = cdiv(V, min(64, _dim(V)))
    programs = N * HV * nvb
    if not varlen:
        NT, nseg = cdiv(T, BT), 1
        if programs * SPLIT_IDLE > n_sm or NT < SPLIT_MIN_SEQ:
            return 0
        while nseg < SPLIT_MAX_SEGS and programs * nseg * 2 <= SPLIT_FILL * n_sm and \
                cdiv(NT, nseg * 2) >= SPLIT_MIN_CHUNKS:
            nseg *= 2
        return cdiv(NT, nseg) if nseg > 1 else 0
    if programs >= SPLIT_BUSY * n_sm or chunks < SPLIT_MIN_SEQ:
        return 0
    L = max(SPLIT_MIN_CHUNKS, cdiv(chunks * HV * nvb, SPLIT_FILL * n_sm))
    return L if chunks > L else 0


def split_launch(plan: ForwardPlan, K: int, V: int, elt: int, gate: int) -> tuple:
    """(value block, warps, pipeline depth) of the split's segment pass: the plan's, else a 64-wide block at 4 warps
    and the depth whose tiles fit two programs per SM."""
    if plan.split_pass is not None:
        return plan.split_pass
    bv = min(64, _dim(V))
    per_stage = elt * BT * (_dim(K) * (2 if gate == 2 else 1) + BT + bv)
    return bv, 4, max(1, min(3, (100 * 1024) // per_stage))


def combine_launch(plan: ForwardPlan | BackwardPlan, V: int) -> tuple:
    """(value block, warps, pipeline depth) of the split's serial combine (split.segment_start_kernel, forward and
    backward): the plan's, else a 64-wide block at 8 warps, 2 stages."""
    if plan.combine is not None:
        return plan.combine
    return min(64, _dim(V)), 8, 2


@dataclass(frozen=True)
class Stage2Launch:
    """A plan's stage 2 resolved for one call's shapes."""
    bv: int
    num_stages: int
    num_warps: int
    p_in: bool
    busy: bool
    nseg: int                     # segments per sequence (1: no split)
    seg_phase1: tuple | None      # (bv, num_warps, num_stages) of the split's first pass
    seg_sub: int                  # its sub-segments per segment
    overlap_mode: int


def resolve_stage2(plan: ForwardPlan, N: int, T: int, HV: int, K: int, V: int, elt: int, gate: int, delta: bool,
                   varlen: bool, n_sm: int) -> Stage2Launch:
    """The value block, depth, segments and P's source of stage 2 for N sequences (T tokens, or T in all with
    varlen) of HV heads at head dims K, V with elt-byte inputs on n_sm SMs, the plan's fixed values kept."""
    NT = cdiv(T, BT)
    programs = N * HV
    bv = plan.bv or _pick_bv(V, K, programs)
    num_stages = plan.num_stages
    mode = plan.overlap
    if mode == 2:       # at bv 64, 2 stages where that grid takes at most half the SMs
        if cdiv(V, min(64, _dim(V))) * programs <= n_sm // 2:
            bv = plan.bv or min(64, _dim(V))
            num_stages = num_stages or 2
        else:
            mode = 0
    # at least two programs per SM: none is alone with its serial loop (latency-bound)
    busy = cdiv(V, bv) * programs >= 2 * n_sm
    nseg, seg_phase1, seg_sub = 1, plan.seg_phase1, plan.seg_sub or 1
    bv_seg = min(64 if K <= 128 else 32, _dim(V))
    few = cdiv(V, bv_seg) * programs < n_sm
    if not delta and gate != 2 and not varlen and (plan.segments is not None or few):
        # simple GLA's state is linear: a few segments per sequence run side by side and fill the GPU at two
        # programs per SM, as a large batch does (only where the unsplit grid leaves SMs idle: it costs a pass)
        nseg = plan.segments or _pick_segments(NT, cdiv(V, bv_seg) * programs, n_sm)
        if nseg > 1:
            bv, busy = plan.bv or bv_seg, True
            if plan.segments is None and plan.seg_phase1 is None and plan.seg_sub is None:
                # the first pass over all of V (each k tile read once per head), in sub-segments that fill one
                # wave of two programs per SM
                seg_phase1 = (min(SEG_P1_BV, _dim(V)), 4, 3)
                p1 = cdiv(V, seg_phase1[0]) * programs * nseg
                seg_sub = 1
                while p1 * seg_sub * 2 <= 2 * n_sm and seg_sub < 8 and cdiv(NT, nseg * seg_sub * 2) >= 4:
                    seg_sub *= 2
    # simple GLA forms P inside its serial loop when the SMs are busy, and takes it from chunk_p when they are not
    p_in = plan.p_in if plan.p_in is not None else not busy
    if gate == 2:
        p_in = True
    trans = plan.trans and bv >= 64
    if num_stages is None:
        num_stages = _pick_stages(elt, _dim(K), bv, delta, p_in, busy, plan.t_form and gate == 2,
                                  trans and nseg == 1)
        if trans and nseg == 1 and delta and plan.trans_stages is not None:
            num_stages = min(num_stages, plan.trans_stages)
    return Stage2Launch(bv=bv, num_stages=num_stages, num_warps=plan.num_warps, p_in=p_in, busy=busy, nseg=nseg,
                        seg_phase1=seg_phase1, seg_sub=seg_sub, overlap_mode=mode)


# ================================================================================================
# backward
# ================================================================================================

@dataclass(frozen=True)
class BackwardPlan:
    """How chunk_bwd launches its stages (triton/chunk.py; the kernels in bwd_*.py). backward_plan gives the default
    for a GPU architecture, family, input dtype and head dims; tests and sweeps vary a field with
    dataclasses.replace."""
    prec: str               # products of fp32 operands: "tf32", "tf32rn" (rounded to nearest first), "tf32x3"
    state_lowp: bool        # the serial state passes' products from 16-bit operands (16-bit inputs)
    wu_lowp: bool           # the W / U recompute's products from 16-bit operands
    key_lowp: int           # 2: the WY pass's products of T, dW, X, dT, dA (and KDA's state-tile pass's) 16-bit; 0 fp32
    dqk_lowp: int           # the state-tile pass's pairwise products: 0 fp32 operands, 2 as key_lowp, 4 dP split in two
    saved_t_16: bool        # the saving forward may keep T in the 16-bit input dtype (the WY pass rounds it anyway)
    kd_in: bool             # KDA: the state passes take q ⊙ e^G, k ⊙ e^{G_last − G} formed once, not per step
    fused_prep: bool        # no saved stage 1: stage 1's kernel recomputes T, W, U, dR_local in one pass
    dh_ahead: int           # the reverse pass's dR_local load: 0 in the step, 1 a step ahead, 2 kept off the product
    full: frozenset         # launches whose chunk length is the constant 64 where every chunk is whole
    dqk_early: bool         # the state-tile pass loads q, k and the gate before its value loop
    wy_da_scr: bool         # the WY pass reads dAᵀ back from a scratch instead of forming it by products
    overlap: bool           # the forward state pass runs beside the dR_local / W launch (saved stage 1)
    group16: bool           # grouped heads: each value head's dq / dk in the input dtype before the group sum
    dk1_16: bool            # dk's state-tile share in the input dtype between the two passes
    bv: int                 # value block of every kernel with a value loop
    dqk_bk: int             # the state-tile pass's key column block
    wy_bk: int              # the WY pass's key loops' column block
    pair_bk: int            # KDA's pair kernel's channel block
    num_warps: int = 4      # every launch but the state passes'
    state_warps: int = 4    # the forward and reverse state passes
    num_stages: int = 3     # software-pipeline depth of the chunk-parallel launches
    fwd_h_stages: int = 3
    bwd_dh_stages: int = 3
    maxnreg: dict = field(default_factory=dict)     # register caps by kernel name
    # simple GLA's split backward (the delta families' follows their forward): chunks per segment, None as
    # split_chunks picks, 0 none
    split: int | None = None
    combine: tuple | None = None    # the split backward's combines: (bv, num_warps, num_stages); None: combine_launch's

    def regs(self, name: str) -> dict:
        """The launch option capping kernel ``name``'s registers ({} for the compiler's choice)."""
        return {"maxnreg": self.maxnreg[name]} if name in self.maxnreg else {}


def backward_plan(gate: int, delta: bool, dtype: torch.dtype, K: int, V: int, arch: int | None = 90) -> BackwardPlan:
    """The default BackwardPlan for a family (gate kind 0 none / 1 scalar / 2 per channel; delta rule) with inputs of
    ``dtype`` at head dims K, V (as the kernels run them: padded, 16-bit K <= 128), built for CUDA arch ``arch``."""
    BK, half = _dim(K), dtype in (torch.bfloat16, torch.float16)
    # fp32 inputs: tf32x3, about fp32's accuracy. fp16: tf32 truncates fp32 operands toward zero, a bias fp16's finer
    # rounding does not hide (KDA's dq / dg twice fla's error), so tf32 rounded to nearest, and tf32x3 for KDA
    prec = "tf32x3" if dtype == torch.float32 or (dtype == torch.float16 and gate == 2) else \
        "tf32rn" if dtype == torch.float16 else "tf32"
    # bf16 at a 128-wide key tile: the WY pass's products 16-bit too, the pairwise ones that feed dq, dk, dg not (their
    # 16-bit form passed dg's error bound); at other tiles and with fp16 those builds gave wrong gradients on sm_90
    wide = dtype == torch.bfloat16 and BK == 128
    key_lowp = 2 if wide else 0
    # ... and the state-tile pass's pairwise products from dP split into two bf16 parts (~16 significant bits, two bf16
    # products in the time of one tf32 product); KDA's pairwise products are the pair kernel's
    dqk_lowp = (4 if gate != 2 else 2) if wide else 0
    # 8-warp state passes for KDA: measured faster with 16-bit products; with tf32x3 products or wider tiles 8 warps
    # gave wrong gradients on sm_90
    wide8 = half and BK <= 128 and prec != "tf32x3"

    def stages(state_pass: bool = False, reverse_per_channel: bool = False) -> int:
        # 3 (Triton's default) except where one SM's shared memory (232 KB) would not hold the fp32 tiles
        if BK > 128:
            return 1 if state_pass or not half else 2
        if reverse_per_channel and not half and BK > 64:
            return 1
        return 2 if not half and BK > 64 else 3

    plan = BackwardPlan(
        prec=prec, state_lowp=half, wu_lowp=half and wu_lowp_ok(dtype, K, V), key_lowp=key_lowp, dqk_lowp=dqk_lowp,
        # DeltaNet only: GDN's WY pass (dAᵀ through its scratch) was slower with a 16-bit T
        saved_t_16=gate == 0 and delta and wide,
        kd_in=gate == 2 and half,
        # fp16 takes the three launches: the fused pass with fp16 products gave inf gradients at small tiles on sm_90
        fused_prep=delta and gate != 2 and dtype != torch.float16,
        # no gate: kept off K dS' (the product took dR_local as its accumulator and waited on its load); scalar gate:
        # in the step (already pipelined, its scaling keeps it off); KDA: a step ahead, with G_last
        dh_ahead={0: 2, 1: 0, 2: 1}[gate],
        # the masks fold away; the others measured slower or spilled with them
        full={0: frozenset(), 1: frozenset({"fwd_h", "bwd_dh"}),
              2: frozenset({"bwd_dqk", "fwd_h", "bwd_dh"})}[gate],
        dqk_early=gate == 0,        # DeltaNet: their latency under the value loop; the gated passes spill more
        wy_da_scr=delta and gate == 1,      # GDN: 30 % fewer products for a barrier; DeltaNet faster with products
        overlap=gate == 2,          # KDA: its W / dR_local launch is long enough to hide the serial pass
        group16=dtype == torch.bfloat16,    # half the bytes; fp16 keeps fp32 shares (its finer rounding shows)
        dk1_16=delta and gate != 2 and half,
        bv=min(32, _dim(V)), dqk_bk=min(64, BK), wy_bk=min(32, BK), pair_bk=min(32, BK),
        state_warps=8 if gate == 2 and wide8 else 4,
        num_stages=stages(), fwd_h_stages=stages(True), bwd_dh_stages=stages(True, gate == 2),
        # KDA's small chunk-parallel launches capped for a third / fourth program per SM
        maxnreg={"intra_diag": 168, "solve": 128, "wu": 168} if gate == 2 and wide8 else {},
    )
    if arch != 90:
        # unmeasured: no register caps, no second stream, pipeline depths that fit a smaller shared memory
        plan = replace(plan, overlap=False, maxnreg={}, num_stages=min(plan.num_stages, 2),
                       fwd_h_stages=min(plan.fwd_h_stages, 2), bwd_dh_stages=min(plan.bwd_dh_stages, 2))
    return plan


def gate_scaled_in(g, q) -> bool:
    """Whether the backward's state passes take KDA's q ⊙ e^G and k ⊙ e^{G_last − G} (BackwardPlan.kd_in), which the
    saving forward then keeps: a per-channel gate with 16-bit inputs."""
    return g is not None and g.dim() == 4 and q.dtype in (torch.bfloat16, torch.float16)


def saved_t_dtype(dtype: torch.dtype, K: int, gate: int, t_form: bool = False) -> torch.dtype:
    """The dtype the saving forward stores T in for inputs of ``dtype`` at head dim K: the input dtype where the
    backward's only reader of T rounds it to that dtype anyway (BackwardPlan.saved_t_16), else fp32; fp32 under the
    T form (``t_form``: the backward forms W from T)."""
    return dtype if not t_form and backward_plan(gate, True, dtype, K, K).saved_t_16 else torch.float32
