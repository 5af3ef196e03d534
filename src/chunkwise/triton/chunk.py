"""Host orchestration of the chunk kernels: the forward as a short sequence of stage calls, what it keeps for the
backward, and the backward.

Stages (docs/design.md): stage 1 (triton/stage1.py) forms per chunk A, T = (I + A)⁻¹, W / U or T diag(β), P and
KDA's gated keys and queries, fully parallel; stage 2 (triton/stage2.py) runs the state through the chunks of each
sequence and writes the output. Launch choices come from the plan (triton/configs.py).
"""
from __future__ import annotations

import contextlib

import torch

from ..utils import TRITON_MAX_HEAD_DIM as MAX_K   # the backward's kernels fit one SM's shared memory up to it
from ..utils import prepare_chunk_indices
from .bwd_kda import pair_grads
from .bwd_states import Problem, forward_state_pass, gate_cumsum, gate_scaled, reverse_state_pass
from .bwd_tiles import group_sum, state_tile_pass
from .bwd_wy import recompute_stage1, stage1_from_saved, wy_pass
from .common import (BT, _alloc, _num_sms, _overlap, _serial_first, _side_stream, cdiv, chunk_slots, cut_state,
                     gate_kind, on_tensor_device, pad_last, pad_state, padded_dims, state_dtype, target_arch)
from .configs import (WIDE_16BIT_K, BackwardPlan, ForwardPlan, backward_plan, check_plan, combine_launch, forward_plan,
                      fp16_kda_in_fp32, gate_scaled_in, resolve_stage2, saved_t_dtype, split_chunks, split_launch)
from .split import (combine, decay_transitions, final_states, first_states, pseudo_count, segment_grads,
                    segment_starts, split_batch, transition_rows)
from .stage1 import chunk_p, chunk_prepare
from .stage2 import chunk_state_output

# ------------------------------------------------------------------------------------------------
# what the forward keeps for the backward
# ------------------------------------------------------------------------------------------------

# the names of what a saving forward hands to the backward, in the order the custom op returns them (the per-chunk
# states are never kept: the backward forms them from R; a split forward keeps its segments' entering states hs and
# transitions mm, from which the backward's state passes run split too)
SAVED = ("w", "u", "p", "t", "hs", "mm", "r", "qg", "kg", "G", "ht")
TOKEN_INDEXED = ("w", "u", "p", "t", "r", "qg", "kg", "G")     # [B, T, ...]


def saves_stage1(q, v, g, beta) -> bool:
    """Whether chunk_fwd(saved_out=...) keeps stage 1 for these inputs: the delta families at head dims the kernels
    take as they are (not padded), except where the backward runs in fp32 (16-bit with K > WIDE_16BIT_K, fp16 KDA on
    the GPU) and GDN / DeltaNet with fp16 inputs (their saved stage 1 gave inf gradients at small tiles on sm_90;
    their backward recomputes it)."""
    if beta is None or (q.dtype != torch.float32 and q.shape[-1] > WIDE_16BIT_K) or fp16_kda_in_fp32(q, g):
        return False
    if q.dtype == torch.float16 and gate_kind(g) < 2:
        return False
    return padded_dims(q, v) == (q.shape[-1], v.shape[-1])


def delta_split(plan: ForwardPlan, q, v, cu_seqlens) -> int:
    """Chunks per segment of the sequence split (configs.split_chunks) for these inputs, from their shapes alone
    (varlen: the most chunks the shapes allow), as the delta families' forward and a split backward take it."""
    B, T, HV, K, V = q.shape[0], q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else B
    return split_chunks(plan, N, T, HV, K, V, varlen, chunk_slots(N, T, varlen), _num_sms(q.device))


def saved_shapes(q, v, g, beta, cu_seqlens, transpose_state_layout=False) -> list:
    """(shape, dtype) per name of SAVED that chunk_fwd(saved_out=...) fills for these inputs, None where it keeps
    nothing: w (not under T_FORM, where the backward forms W, U from T), p, t, a split forward's segment states and
    transitions (hs, mm), R (instead of u: R = U − W S is all the backward reads U for), KDA's qg, kg (where the
    backward's state passes take them) and G, and DeltaNet's final state (its backward's reverse state pass forms the
    per-chunk states from it; split: every segment's end state)."""
    names = dict.fromkeys(SAVED)
    if not saves_stage1(q, v, g, beta):
        return list(names.values())
    B, T, HV, K, V = q.shape[0], q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    gate = gate_kind(g)
    plan = forward_plan(q.device, q.dtype, gate, True, K, V, save=True)
    t_form = plan.t_form
    if not t_form:
        names["w"] = ((B, T, HV, K), q.dtype)
    seg = delta_split(plan, q, v, cu_seqlens)
    if seg:
        NP = pseudo_count(B, T, N, cu_seqlens is not None, seg)
        names["hs"], names["mm"] = ((NP, HV, K, V), torch.float32), ((NP, HV, K, K), torch.float32)
    names["p"] = ((B, T, HV, BT), q.dtype)
    names["t"] = ((B, T, HV, BT), saved_t_dtype(q.dtype, K, gate, t_form))
    names["r"] = ((B, T, HV, V), state_dtype(q.dtype))
    if gate == 2:
        if gate_scaled_in(g, q):
            names["qg"] = names["kg"] = ((B, T, HV, K), q.dtype)
        names["G"] = ((B, T, HV, K), torch.float32)
    if gate == 0:       # (split: every segment's end state, as stage 2 left it)
        names["ht"] = ((NP, HV, K, V) if seg else (N, HV, V, K) if transpose_state_layout else (N, HV, K, V),
                       torch.float32)
    return list(names.values())


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------

@on_tensor_device
def chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *, chunk_indices=None,
              transpose_state_layout=False, plan: ForwardPlan | None = None, saved_out: dict | None = None,
              checkpoints: tuple | None = None):
    """The chunk forward of all four families (canonical inputs: see chunkwise.triton).

    Returns (o [B,T,HV,V] in q's dtype, final state fp32 [N,HV,K,V] ([N,HV,V,K] transposed) or None).
    ``plan``: the launch plan (default: configs.forward_plan's for these inputs; its None fields are picked from the
    shapes). ``saved_out``: a dict that, where saves_stage1, receives what the backward reuses (SAVED, saved_shapes).
    Head dims the kernels do not take as they are run zero-padded; 16-bit inputs with K > WIDE_16BIT_K run in fp32.
    ``checkpoints``: (buffer, slots, every): stage 2 also writes sequence n's state after each whole ``every`` tokens
    (a multiple of BT) to buffer[slots[n] + j] (buffer [n_ckpt, HV, K, V] contiguous, in the final state's layout,
    any float dtype; slots [N + 1] on the device: chunkwise.checkpoint_slots).
    """
    if q.dtype != torch.float32 and q.shape[-1] > WIDE_16BIT_K:
        o, ht = chunk_fwd(q.float(), k.float(), v.float(), g, None if beta is None else beta.float(), scale,
                          initial_state, output_final_state, cu_seqlens, chunk_indices=chunk_indices,
                          transpose_state_layout=transpose_state_layout, plan=plan, checkpoints=checkpoints)
        return o.to(q.dtype), ht
    save = saved_out is not None and saves_stage1(q, v, g, beta)      # (on the unpadded inputs)
    keep_qk_gated = save and gate_kind(g) == 2 and gate_scaled_in(g, q)
    K0, V0 = q.shape[-1], v.shape[-1]
    Kp, Vp = padded_dims(q, v)
    padded = (Kp, Vp) != (K0, V0)
    if padded:
        q, k, v = pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp)
        g = g if g is None or g.dim() == 3 else pad_last(g, Kp)
        initial_state = pad_state(initial_state, Kp, Vp, transpose_state_layout)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    varlen = cu_seqlens is not None
    gate, delta = gate_kind(g), beta is not None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.float().contiguous()
    beta = None if beta is None else beta.contiguous()
    if plan is None:
        plan = forward_plan(q.device, q.dtype, gate, delta, K, V, save)
    else:
        check_plan(plan)
    n_sm = _num_sms(q.device)
    if varlen and chunk_indices is None and delta:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    # the delta families' sequence split (triton/split.py): the stages run on the batch of segments (sb), every
    # segment from its entering state; the outputs and what the backward keeps are the unsplit forward's, in place
    # (not with checkpoints: stage 2 stores them by each sequence's own chunk index, which a segment does not carry)
    seg = delta_split(plan, q, v, cu_seqlens) if delta and checkpoints is None else 0
    sb = split_batch(q, k, v, g, beta, cu_seqlens, chunk_indices, seg) if seg else None
    q1, k1, v1, g1, beta1, cu1, ci1, N1 = (q, k, v, g, beta, cu_seqlens, chunk_indices, N) if sb is None else \
        (sb.q, sb.k, sb.v, sb.g, sb.beta, sb.cu_seqlens, sb.chunk_indices, sb.N)
    T1, varlen1 = q1.shape[1], cu1 is not None
    launch = resolve_stage2(plan, N1, T1, HV, K, V, q.element_size(), gate, delta, varlen1, n_sm)
    if varlen and chunk_indices is None and launch.p_in:     # (simple GLA forming P once per chunk)
        chunk_indices = ci1 = prepare_chunk_indices(cu_seqlens, BT)

    # stage 2's outputs first: beside stage 1, everything it writes exists before stage 1 is launched
    o = _alloc((B, T, HV, V), q.dtype, q.device)
    ht = None
    # DeltaNet: the backward forms the per-chunk states back from the final one (split: from each segment's, below)
    keep_ht = save and gate == 0
    if output_final_state or (keep_ht and not seg):
        ht = _alloc((N, HV, V, K) if transpose_state_layout else (N, HV, K, V), torch.float32, q.device)
    rs = _alloc((B, T, HV, V), state_dtype(q.dtype), q.device) if save else None   # R, for the backward

    n_chunks = (ci1.shape[0] if varlen1 else cdiv(T1, BT)) if delta else 0
    programs = cdiv(V, launch.bv) * N1 * HV
    overlap = sb is None and launch.overlap_mode > 0 and launch.nseg == 1 and \
        _overlap(programs, n_sm, n_chunks, q.device)
    ready = side = prep = None
    # stage 2 beside stage 1, on a high-priority stream of its own that does not wait for it; where stage 2 goes first
    # (common._serial_first), stage 1 on a normal-priority one. Stage 1 is launched first, so that with one hardware
    # queue (CUDA_DEVICE_MAX_CONNECTIONS=1) it never queues behind stage 2's programs waiting on it
    if overlap:
        ready = torch.zeros((chunk_slots(N1, T1, varlen1), HV), dtype=torch.int32, device=q.device)
        side = _side_stream(q.device)
        if _serial_first(programs, n_sm):
            prep = _side_stream(q.device, high=False)

    if delta:
        with torch.cuda.stream(prep) if prep is not None else contextlib.nullcontext():
            stage1 = chunk_prepare(q1, k1, v1, g1, beta1, cu1, ci1, plan=plan, save_t=save,
                                   store_p=launch.p_in or save, ready=ready, save_g=save and gate == 2)
    else:
        stage1 = dict(w=None, u=None, p=None, qg=None, kg=None, glast=None, gcum=None)
        if launch.p_in:                 # simple GLA with P formed once per chunk
            stage1["p"] = chunk_p(q, k, g, HV, cu_seqlens, chunk_indices)
    if not launch.p_in:
        stage1["p"] = None
    if save:
        def whole(x):       # (a token-indexed output of the batch of segments, as the caller's batch)
            return None if x is None else x.view(B, T, *x.shape[2:])
        saved_out.update(p=whole(stage1["p"]), t=whole(stage1["t"]), r=rs)
        if not plan.t_form:     # (under T_FORM, w and u are stage 2's operands: the backward forms W, U from T)
            saved_out.update(w=whole(stage1["w"]))
        if gate == 2:
            saved_out.update(G=whole(stage1["G"]))
            if keep_qk_gated:
                saved_out.update(qg=whole(stage1["qg"]), kg=whole(stage1["kg"]))
        if keep_ht and not seg:
            saved_out.update(ht=ht)

    ckpt = None
    if checkpoints is not None:     # (padded head dims: into a padded copy of the buffer, cut back below)
        buf, slots, every = checkpoints
        ckpt = (pad_state(buf, K, V, transpose_state_layout) if padded else buf, slots, every // BT)
    if sb is None:
        chunk_state_output(q, k, v, g, beta, stage1, o, initial_state, ht, rs, ready, side, cu_seqlens, scale, plan,
                           launch, transpose_state_layout, checkpoints=ckpt)
    else:
        # each segment's transition and entering state, then stage 2 from those
        hs, mm = segment_starts(sb, stage1, g1, initial_state, transpose_state_layout, gate, plan.t_form,
                                plan.dot_prec, plan.mm_prec, HV, K, V, split_launch(plan, K, V, q.element_size(), gate),
                                combine_launch(plan, V), every_m=save)
        # the segments' final states: not into hs, which a program that met a non-finite input reads again
        hx = _alloc(hs.shape, hs.dtype, hs.device)
        chunk_state_output(q1, k1, v1, g1, beta1, stage1, sb.view(o), hs, hx, None if rs is None else sb.view(rs),
                           None, None, cu1, scale, plan, launch)
        if ht is not None:
            final_states(sb, hx, ht, transpose_state_layout)
        if save:
            saved_out.update(hs=hs, mm=mm, split=seg)
            if keep_ht:     # (DeltaNet: each segment's own end state, from which its backward forms its states back)
                saved_out.update(ht=hx)
    for stream in (side, prep):
        if stream is not None:
            torch.cuda.current_stream(q.device).wait_stream(stream)
    if not output_final_state:
        ht = None
    if padded:
        o, ht = o[..., :V0].contiguous(), cut_state(ht, K0, V0, transpose_state_layout)
        if ckpt is not None:
            buf.copy_(cut_state(ckpt[0], K0, V0, transpose_state_layout))
    return o, ht


# ------------------------------------------------------------------------------------------------
# backward (chunk_bwd, the backward's stages in order: triton/bwd_*.py)
# ------------------------------------------------------------------------------------------------

@on_tensor_device
def chunk_bwd(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, *, chunk_indices=None,
              transpose_state_layout=False, saved: dict | None = None, plan: BackwardPlan | None = None):
    """Gradients of the chunk op.

    q, k: [B, T, H, K]; v, do: [B, T, HV, V]; g: None | [B, T, HV] | [B, T, HV, K] fp32; beta: None | [B, T, HV];
    initial_state: None | [N, HV, K, V] ([N, HV, V, K] transposed); dht: None | like the final state (fp32, same
    layout); cu_seqlens: None | [N + 1] (B == 1). Returns (dq, dk, dv, dg, dbeta, dh0), each in its input's dtype
    and layout (None where the input is None). K > MAX_K raises NotImplementedError.
    ``saved``: what the saving forward kept (chunk_fwd's ``saved_out``: p, t, r, and w unless under the T form;
    KDA's G and, with 16-bit inputs, qg, kg; DeltaNet's final state ht, every segment's where split), used instead
    of recomputing stage 1 and the forward state pass; ignored where the head dims are padded or the inputs run in
    fp32. ``plan``: the launch plan (default: configs.backward_plan for these inputs and this GPU; not applied where
    the inputs run in fp32).
    Head dims the kernels do not take as they are run zero-padded (common.padded_dims). The launches in order
    (docs/design.md, section 6): the gate cumsum, stage 1's operands, the forward and reverse state passes, the
    state-tile pass, the WY pass, KDA's pairwise gradients, the group sum of grouped heads.
    """
    if q.dtype != torch.float32 and (WIDE_16BIT_K < q.shape[-1] <= MAX_K or fp16_kda_in_fp32(q, g)):
        # 16-bit inputs with K > 128, or fp16 KDA on the GPU, run in fp32; gradients in the inputs' dtypes
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(
            q.float(), k.float(), v.float(), g, None if beta is None else beta.float(), scale, initial_state,
            do.float(), dht, cu_seqlens, chunk_indices=chunk_indices, transpose_state_layout=transpose_state_layout)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, None if dbeta is None else dbeta.to(beta.dtype),
                dh0)
    K0, V0 = q.shape[-1], v.shape[-1]
    Kp, Vp = padded_dims(q, v)
    padded = (Kp, Vp) != (K0, V0) and K0 <= MAX_K
    if padded or beta is None or not saved:
        saved = None
    tr = transpose_state_layout
    if padded:
        q, k, v, do = pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp), pad_last(do, Vp)
        g = g if g is None or g.dim() == 3 else pad_last(g, Kp)
        initial_state, dht = pad_state(initial_state, Kp, Vp, tr), pad_state(dht, Kp, Vp, tr)
    if q.shape[-1] > MAX_K:
        raise NotImplementedError(
            f"the triton chunk backward supports head dims K <= {MAX_K} (got K={q.shape[-1]}): wider keys would need "
            f"more shared memory than one SM has; use backend='torch' to train with K={q.shape[-1]}")
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    do_shape = do.shape
    g = None if g is None else g.contiguous()
    beta = None if beta is None else beta.contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    dht = None if dht is None else dht.contiguous()
    if plan is not None:
        check_plan(plan)
    plan = plan or backward_plan(gate_kind(g), beta is not None, q.dtype, q.shape[-1], v.shape[-1],
                                 target_arch(q.device))
    # a split forward (triton/split.py): the backward runs on its batch of segments, each from its entering state
    # (hs) and with its exiting state's gradient (segment_grads), so that the serial passes fill the GPU too. Simple
    # GLA (its forward keeps nothing) splits where the delta families' forward would, its entering states formed here
    sb = seg_mm = None
    h0_in, tr0 = h0, tr
    seg, seg_prec = 0, plan.prec
    if beta is None and gate_kind(g) == 1:
        # (its combines at fp32's accuracy: its unsplit passes round nothing, where one tf32 rounding at each
        # segment's boundary gave dh0 2e-4 against 1e-7 at real size)
        seg, seg_prec = plan.split, "tf32x3"
        if seg is None:
            seg = delta_split(forward_plan(q.device, q.dtype, 1, False, q.shape[-1], v.shape[-1]), q, v, cu_seqlens)
    elif saved is not None and saved.get("hs") is not None:
        seg = saved.get("split") or delta_split(
            forward_plan(q.device, q.dtype, gate_kind(g), True, q.shape[-1], v.shape[-1], save=True), q, v, cu_seqlens)
    if seg:
        if cu_seqlens is not None and chunk_indices is None:
            chunk_indices = prepare_chunk_indices(cu_seqlens, BT).to(q.device)
        sb = split_batch(q, k, v, g, beta, cu_seqlens, chunk_indices, seg)
        if saved is not None:       # (the delta families: their forward kept each segment's entering state and M)
            if saved["hs"].shape[0] != sb.N:
                raise ValueError(f"saved['hs'] holds {saved['hs'].shape[0]} segment states, the split of these "
                                 f"inputs into segments of {seg} chunks {sb.N}")
            saved = {n: sb.view(x) if n in TOKEN_INDEXED and x is not None else x for n, x in saved.items()}
            h0, seg_mm = saved["hs"], saved["mm"]
        q, k, v, g, beta, cu_seqlens, chunk_indices = sb.q, sb.k, sb.v, sb.g, sb.beta, sb.cu_seqlens, sb.chunk_indices
        do, tr = sb.view(do), False
    p = Problem.of(q, v, g, beta, cu_seqlens, chunk_indices)
    gate, delta, dev = p.gate, p.delta, q.device
    B, T, H, HV, K, V, C = p.B, p.T, p.H, p.HV, p.K, p.V, p.C
    combine_at = combine_launch(plan, V)        # (the split's combines)

    # the gate's chunk-local cumsum (KDA's saved by the forward)
    G = None
    if saved is not None and saved.get("G") is not None:
        G = saved["G"].contiguous()
    elif gate:
        G = gate_cumsum(g, p, plan)
    # fp32 scratch [B, T, HV, C]: A and P where the three recompute launches form them, the WY pass's dAᵀ (GDN),
    # KDA's dA and dP for the pair kernel (one buffer AP: it also takes the state-tile pass's dT shares)
    AP = Amat = Pmat = None
    recompute3 = saved is None and not plan.fused_prep
    if gate == 2:
        AP = p.alloc(2, B, T, HV, C)
        Amat, Pmat = AP[0], AP[1]
    else:
        Amat = p.alloc(B, T, HV, C) if delta and recompute3 else None    # (the WY pass's scratch alone: below)
        Pmat = p.alloc(B, T, HV, C) if recompute3 else None
    # KDA: the state passes' q ⊙ e^G, k ⊙ e^{G_last − G} (saved by the forward, or formed here)
    q_s, k_s = q, k
    if plan.kd_in:
        q_s, k_s = (saved["qg"].contiguous(), saved["kg"].contiguous()) if saved is not None else \
            gate_scaled(q, k, G, p, plan)
    # DeltaNet with saved stage 1: the reverse state pass forms the per-chunk states from the final state
    rev_h = saved is not None and gate == 0
    # KDA with saved stage 1: the forward state pass on a second stream beside the dR_local / W launch (it reads
    # R, not W), made to wait for the work launched so far
    beside = saved is not None and plan.overlap and \
        _overlap(p.grid_s(plan)[0] * p.grid_s(plan)[1], _num_sms(dev), p.NT, dev)
    side = _side_stream(dev) if beside else None

    # stage 1's operands: dR_local always, T, W (and U to form R) where the forward did not save them
    if saved is not None:
        Tmat, W, dRl = stage1_from_saved(k, v, beta, G, do, scale, saved, p, plan)
        R = saved["r"].contiguous()
    else:
        Tmat, W, U, dRl = recompute_stage1(q, k, v, g, beta, G, do, scale, Amat, Pmat, p, plan)
        R = p.alloc(B, T, HV, V, dtype=state_dtype(q.dtype)) if delta else None
    if sb is not None and seg_mm is None:
        # simple GLA: each segment's end state from zero (a state pass that stores nothing else), its transition
        # e^{Σ g}·I, the combine from the caller's initial state: every segment's entering state
        ends = forward_state_pass(k, v, G, None, None, None, None, p, plan, False, False, ends=True)
        seg_mm = decay_transitions(sb, g, K)
        h0 = combine(sb, h0_in, transition_rows(sb, ends), seg_mm, tr0, seg_prec, combine_at)
        del ends
    # the forward state pass: h (and R = U − W S where not saved)
    h = None
    if saved is not None and not rev_h:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            h = forward_state_pass(k_s, R, G, None, None, None, h0, p, plan, tr, beside)
    elif saved is None:
        h = forward_state_pass(k_s, v, G, W, U, R, h0, p, plan, tr, False)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    if rev_h:
        h = p.alloc(p.NC, HV, K, V, dtype=state_dtype(q.dtype))
    # the reverse state pass: dh, dR, dh0 (DeltaNet's h too, backwards from the final state). Split: first without
    # the exiting states' gradients, for each segment's own share of its entering state's, then the reverse combine
    # gives every segment's exiting state's gradient
    dht_s = dht
    if sb is not None:
        _, _, nq = reverse_state_pass(q_s, k_s, G, W, dRl, do, None, None, h0, scale, p, plan, tr, store=False)
        dht_s = segment_grads(sb, nq, seg_mm, dht, tr0, seg_prec, combine_at)
    dh, dR, dh0 = reverse_state_pass(q_s, k_s, G, W, dRl, do, dht_s, h, h0, scale, p, plan, tr,
                                     ht=saved["ht"].contiguous() if rev_h else None, R=R if rev_h else None)
    del dRl, q_s, k_s

    # gradients leave the kernels in the input dtype unless the pair kernel finishes them (KDA: fp32 until then);
    # grouped value heads' per-head shares in it only with plan.group16, else fp32 for group_sum
    gdt = q.dtype if gate != 2 and (HV == H or plan.group16) else torch.float32
    dq, dk = p.alloc(B, T, HV, K, dtype=gdt), p.alloc(B, T, HV, K, dtype=gdt)
    dG = p.alloc(*g.shape) if gate == 2 else None       # (KDA's: the state-tile pass writes it)
    # the state-tile pass: dq, dk1 (dk's state and P terms), dW, the gate's shares (per key column block, or per
    # channel: dG itself, with dT's and dβ's shares in dTp, dbs), then the WY pass
    nka = cdiv(K, plan.dqk_bk)
    dk1_dt = q.dtype if plan.dk1_16 else torch.float32
    dk1 = dk if not delta or dk.dtype == dk1_dt else p.alloc(B, T, HV, K, dtype=dk1_dt)
    dW = p.alloc(B, T, HV, K, dtype=q.dtype if plan.key_lowp else torch.float32) if delta and gate != 2 else None
    dGp = None if not gate else (dG if gate == 2 else p.alloc(nka, B, T, HV))
    dTp = dbs = None
    if gate == 2:   # (dTp in AP where two blocks or fewer: the WY pass reads its rows of it before it writes them)
        dTp = AP if nka <= 2 else p.alloc(nka, B, T, HV, C)
        dbs = p.alloc(nka, B, T, HV)
    state_tile_pass(q, k, v, G, h, dh, R if delta else None, dR, do, dq, dk1, dW, dGp, Tmat, beta, dTp, dbs, scale,
                    p, plan)
    # what only the WY pass writes or reads, allocated once the per-chunk states are freed (off the peak of memory)
    del h, dh
    dv = p.alloc(B, T, HV, V, dtype=v.dtype) if delta else None
    dbeta = p.alloc(B, T, HV) if delta else None
    if gate == 1:
        dG = p.alloc(*g.shape)
    if Amat is None and delta and plan.wy_da_scr:
        Amat = p.alloc(B, T, HV, C)
    wy_pass(k, v, beta, G, Tmat, dW, dR, dk1, dbs if gate == 2 else dGp, Amat, dv, dk, dbeta, dG,
            R if delta else None, do, Pmat, dTp, scale, p, plan)
    if not delta:       # dv = dR
        dv = dR if dR.dtype == v.dtype else dR.to(v.dtype)
    del dk1, dW, dGp, dTp, dbs
    if gate == 2:   # KDA: the pairwise gradients, each finished gradient stored in the input dtype unless summed after
        dq_o, dk_o = dq, dk
        if (HV == H or plan.group16) and q.dtype != dq.dtype:
            dq_o, dk_o = p.alloc(*dq.shape, dtype=q.dtype), p.alloc(*dk.shape, dtype=k.dtype)
        pair_grads(q, k, beta, G, Pmat, Amat, dq, dk, dbeta, dG, dq_o, dk_o, p, plan)
        dq, dk = dq_o, dk_o
    if HV != H:     # per value head -> per key head
        dq, dk = group_sum(dq, H, q.dtype), group_sum(dk, H, k.dtype)
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dG = None if dG is None else dG.to(g.dtype)
    if sb is not None:      # the caller's batch: its tokens, each sequence's dh0 its first segment's
        B, T = do_shape[:2]
        dq, dk, dv = (x.view(B, T, *x.shape[2:]) for x in (dq, dk, dv))
        dG = None if dG is None else dG.view(B, T, *dG.shape[2:])
        dbeta = None if dbeta is None else dbeta.view(B, T, *dbeta.shape[2:])
        dh0 = None if initial_state is None else first_states(sb, dh0, tr0)
        tr = tr0
    dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
    if padded:
        dq, dk, dv = dq[..., :K0].contiguous(), dk[..., :K0].contiguous(), dv[..., :V0].contiguous()
        dG = dG if dG is None or dG.dim() == 3 else dG[..., :K0].contiguous()
        dh0 = cut_state(dh0, K0, V0, tr)
    return dq, dk, dv, dG, None if dbeta is None else dbeta.to(beta.dtype), dh0
