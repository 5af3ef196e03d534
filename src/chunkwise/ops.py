"""The public ops: thin entry points over `api.run`, one per family and form.

Every op computes, per sequence, per value head h (q/k head h // (HV // H)), per token t::

    S' = diag(exp(g_t)) · S_{t-1}
    S_t = S' + β_t · k_t · (v_t − S'ᵀ k_t)ᵀ        (delta families)
    S_t = S' + k_t · v_tᵀ                          (simple GLA)
    o_t = scale · S_tᵀ q_t

``chunk_*`` uses the chunk algorithm (training, prefill); ``fused_recurrent_*`` steps token by
token (decode, speculative decoding). Both take the same arguments in the same order.
"""
from __future__ import annotations

import torch

from . import api
from .api import DELTA, GDN, GLA, KDA
from .distributed import chunk_cp
from .prefill import chunk_serving


def run(fam, mode, *args, cp_group=None, checkpoint_every=None, checkpoints=None, **kwargs):
    """``api.run``, or ``distributed.chunk_cp`` for a call split over the ranks of ``cp_group``."""
    if cp_group is not None:
        if checkpoint_every is not None or checkpoints is not None:
            raise ValueError("state_indices / checkpoint_every are not available with cp_group")
        return chunk_cp(fam, mode, *args, cp_group=cp_group, **kwargs)
    return api.run(fam, mode, *args, checkpoint_every=checkpoint_every, checkpoints=checkpoints, **kwargs)


def _serving(op, tensors, args):
    """A chunk op's call with state_indices (a pool): ``prefill.chunk_serving`` over the plain op."""
    args = {n: x for n, x in args.items() if n not in ("q", "k", "v", "g", "beta")}
    if args.pop("cp_group") is not None:
        raise ValueError("state_indices / checkpoint_every are not available with cp_group")
    return chunk_serving(op, tensors, args.pop("scale"), args.pop("initial_state"), args.pop("output_final_state"),
                         args.pop("cu_seqlens"), **args)

_COMMON = """
    Args:
        q: [B, T, H, K] queries (float16 / bfloat16 / float32; float64 on the torch backend).
        k: [B, T, H, K] keys, same dtype as q.
        v: [B, T, HV, V] values; HV must be a multiple of H (value head h reads q/k head h // (HV // H)).
{gate}{beta}        scale: the output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] (or [N, HV, V, K] with transpose_state_layout) state entering each
            sequence, any float dtype, read in fp32 (float64 when q is float64); N = B, or the number of
            sequences with cu_seqlens.
        output_final_state: also return the state after each sequence, [N, HV, K, V] fp32 (float64 when
            q is float64), in the chosen layout.
        cu_seqlens: [N + 1] int32/int64 offsets of N sequences packed along T (then B must be 1), as in
            FlashAttention's varlen API. Each sequence starts from its own initial state.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K inside the op (x / sqrt(Σx² + 1e-6)).
{beta_sigmoid}{gate_args}        transpose_state_layout: states as [N, HV, V, K] (vLLM / FlashInfer layout) instead of [N, HV, K, V].
        state_v_first: fla 0.6.0's name for transpose_state_layout (either one sets that layout).
        chunk_size: chunk length of the torch backend's chunk algorithm (32: the fastest on the CPU,
            README "CPU performance"); the result does not depend on it. The triton kernels use 64.
        backend: "auto" (triton for CUDA tensors when triton is installed, torch otherwise), "torch" or "triton".
        cu_seqlens_cpu: optional host copy of cu_seqlens: lets the op check and plan without a device sync.
        chunk_indices: optional `prepare_chunk_indices(cu_seqlens)` computed once per batch (triton varlen).
{extra}
    Returns:
        o: [B, T, HV, V] in q's dtype.
        final_state: [N, HV, K, V] (or [N, HV, V, K]) fp32 (float64 when q is float64) if output_final_state,
            else None.
"""

_G_SCALAR = ("        g: [B, T, HV] log-space decay per token and value head (≤ 0), fp32 or q's dtype. With\n"
             "            use_gate_in_kernel it is the raw projection a and g = −exp(A_log)·softplus(a + dt_bias).\n")
_G_CHANNEL = ("        g: [B, T, HV, K] log-space decay per token, value head and key channel (≤ 0). With\n"
              "            use_gate_in_kernel it is the raw projection a and g = −exp(A_log)·softplus(a + dt_bias),\n"
              "            or lower_bound·sigmoid(exp(A_log)·(a + dt_bias)) when lower_bound is given.\n")
_BETA = "        beta: [B, T, HV] write strength, usually in (0, 1).\n"
_BETA_SIG = ("        use_beta_sigmoid_in_kernel: apply sigmoid to beta inside the op (beta holds logits).\n"
             "        allow_neg_eigval: with use_beta_sigmoid_in_kernel, beta = 2·sigmoid(logits) in (0, 2), so that\n"
             "            I − β k kᵀ has eigenvalues down to −1 (fla's allow_neg_eigval).\n")
_GATE_SCALAR = ("        use_gate_in_kernel: compute g from raw projections with A_log [HV] and dt_bias [HV].\n"
                "        A_log, dt_bias: gate parameters for use_gate_in_kernel (differentiable).\n")
_GATE_CHANNEL = ("        use_gate_in_kernel: compute g from raw projections with A_log [HV] and dt_bias [HV·K].\n"
                 "        A_log, dt_bias: gate parameters for use_gate_in_kernel (differentiable).\n"
                 "        lower_bound: optional negative float: the sigmoid-bounded gate of Kimi Linear; A_log may\n"
                 "            then be None: g = lower_bound·sigmoid(a + dt_bias).\n"
                 "        safe_gate: fla's promise that g lies in [lower_bound, 0) (its faster path); with\n"
                 "            use_gate_in_kernel it needs lower_bound in [-5, 0), as fla checks. Our kernels take any\n"
                 "            gate, so it changes nothing else.\n")
_GATE_GLA = _GATE_SCALAR + (
    "        g_gamma: [HV] log-space decay per value head, the same at every token (fla's g_gamma; then g is\n"
    "            None).\n")
_POOL = ("        state_indices: [N] int, vLLM-style state pool: initial_state is then a pool [P, HV, K, V] (or\n"
         "            [P, HV, V, K]); sequence n reads pool[state_indices[n]] and writes its final state back\n"
         "            there in place (in the pool's dtype, fp32 or bf16). -1 marks a padding slot: skipped, its\n"
         "            output is zero. With output_final_state the pool itself is returned.\n"
         "        intermediate_states: [N, T_draft, HV, K, V] (or [N, T_draft, HV, V, K]) in the pool's dtype (fp32\n"
         "            for an 8-bit pool), the verify step of speculative decoding (FlashInfer's\n"
         "            intermediate_states_buffer with disable_state_update): the state after draft token t of\n"
         "            sequence n is written to [n, t] (T_draft <= 16, varlen by cu_seqlens) and the pool is not\n"
         "            updated; then\n"
         "            chunkwise.rollback(pool, state_indices, intermediate_states, num_accepted_tokens) keeps\n"
         "            the state after each sequence's last accepted token (state_scales= too for an 8-bit pool).\n"
         "        state_scales: [P, HV, K] fp32 (or [P, HV, V] with transpose_state_layout) with an 8-bit pool\n"
         "            (torch.int8 or torch.float8_e4m3fn): value = stored · scale of its row. Each written row is\n"
         "            requantized with its new absmax (127 for int8, 448 for e4m3); the scales are updated in place.\n")

_CP = ("        cp_group: a torch.distributed ProcessGroup for context parallelism: each rank passes its contiguous\n"
       "            slice of the tokens (rank order) with the whole batch's cu_seqlens / initial_state; sequence n's\n"
       "            final state is on the rank holding its last token (zero rows elsewhere). See chunkwise.distributed.\n")

_PREFILL = ("        state_indices: [N] int (vLLM's ssm_state_indices, FlashInfer's state_indices): initial_state is\n"
            "            then a pool [P, HV, K, V] (or [P, HV, V, K]); sequence n starts from pool[state_indices[n]], its\n"
            "            final state is written back there in place (no host sync, CUDA-graph capturable). -1 skips a\n"
            "            sequence (output zero); an index outside [0, P) never touches memory outside the pool.\n"
            "            Inference only (refused when gradients are required). See chunkwise.prefill.\n"
            "        has_initial_state: optional bool [N] (vLLM's name): False starts sequence n from a zero state.\n"
            "        checkpoint_every: C, a multiple of 64 (FlashInfer's checkpoint_every_n_tokens): write the state\n"
            "            after every C tokens of each sequence to checkpoints (prefix caching). The triton backend's\n"
            "            forward kernel stores them as it goes (no host sync, CUDA-graph capturable); the torch\n"
            "            backend runs the batch in C-token pieces. Inference only.\n"
            "        checkpoints: [Σ_n ⌊len_n / C⌋, HV, K, V] float buffer (or [.., HV, V, K]), packed sequence by\n"
            "            sequence in token order; chunkwise.checkpoint_slots(cu_seqlens, C) gives each sequence's first\n"
            "            slot (its length is checked where the lengths are on the host: cu_seqlens_cpu).\n"
            "        state_scales: [P, HV, K] fp32 with an 8-bit pool (int8 / float8_e4m3fn), as the decode op takes it:\n"
            "            rows read dequantized, written back requantized (their scales updated in place).\n")


def _doc(title: str, equation: str, gate: str = "", beta: bool = True, gate_args: str = "", pool: bool = False,
         cp: bool = False):
    return (title + "\n\n    " + equation + "\n" + _COMMON.format(
        gate=gate, beta=_BETA if beta else "", beta_sigmoid=_BETA_SIG if beta else "",
        gate_args=gate_args, extra=(_POOL if pool else "") + ((_PREFILL + _CP) if cp else "")))


# --- Gated DeltaNet (Qwen3-Next) -----------------------------------------------------------------

def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *,
                           use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, use_gate_in_kernel: bool = False,
                           A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           transpose_state_layout: bool = False, state_v_first: bool = False, chunk_size: int = 32,
                           backend: str = "auto", cu_seqlens_cpu: torch.Tensor | None = None,
                           chunk_indices: torch.Tensor | None = None, cp_group=None,
                           state_indices: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None,
                           checkpoint_every: int | None = None,
                           checkpoints: torch.Tensor | None = None, state_scales: torch.Tensor | None = None):
    if state_indices is not None or state_scales is not None:
        return _serving(chunk_gated_delta_rule, (q, k, v, g, beta), locals())
    return run(GDN, "chunk", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
               transpose_state_layout=transpose_state_layout, state_v_first=state_v_first, chunk_size=chunk_size,
               backend=backend, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, cp_group=cp_group,
               checkpoint_every=checkpoint_every, checkpoints=checkpoints)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                                     cu_seqlens: torch.Tensor | None = None, *, use_qk_l2norm_in_kernel: bool = False,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
                                     dt_bias: torch.Tensor | None = None, transpose_state_layout: bool = False,
                                     state_v_first: bool = False, chunk_size: int = 32, backend: str = "auto",
                                     cu_seqlens_cpu: torch.Tensor | None = None,
                                     chunk_indices: torch.Tensor | None = None,
                                     state_indices: torch.Tensor | None = None,
                                     intermediate_states: torch.Tensor | None = None,
                                     state_scales: torch.Tensor | None = None):
    return run(GDN, "recurrent", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
               transpose_state_layout=transpose_state_layout, state_v_first=state_v_first, chunk_size=chunk_size,
               backend=backend, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
               state_indices=state_indices,
               intermediate_states=intermediate_states, state_scales=state_scales)


_GDN_EQ = "S_t = (I − β_t k_t k_tᵀ) exp(g_t) S_{t−1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t   (g scalar per head)"
chunk_gated_delta_rule.__doc__ = _doc("Gated DeltaNet, chunk form (training / prefill).", _GDN_EQ, _G_SCALAR,
                                      gate_args=_GATE_SCALAR, cp=True)
fused_recurrent_gated_delta_rule.__doc__ = _doc("Gated DeltaNet, token-recurrent form (decode).", _GDN_EQ, _G_SCALAR,
                                                gate_args=_GATE_SCALAR, pool=True)


# --- Kimi Delta Attention ------------------------------------------------------------------------

def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              cu_seqlens: torch.Tensor | None = None, *, use_qk_l2norm_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
              use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
              dt_bias: torch.Tensor | None = None, lower_bound: float | None = None, safe_gate: bool = False,
              transpose_state_layout: bool = False, state_v_first: bool = False, chunk_size: int = 32,
              backend: str = "auto", cu_seqlens_cpu: torch.Tensor | None = None,
              chunk_indices: torch.Tensor | None = None, cp_group=None, state_indices: torch.Tensor | None = None,
              has_initial_state: torch.Tensor | None = None, checkpoint_every: int | None = None,
              checkpoints: torch.Tensor | None = None, state_scales: torch.Tensor | None = None):
    if state_indices is not None or state_scales is not None:
        return _serving(chunk_kda, (q, k, v, g, beta), locals())
    return run(KDA, "chunk", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
               lower_bound=lower_bound, safe_gate=safe_gate, transpose_state_layout=transpose_state_layout,
               state_v_first=state_v_first, chunk_size=chunk_size, backend=backend, cu_seqlens_cpu=cu_seqlens_cpu,
               chunk_indices=chunk_indices, cp_group=cp_group,
               checkpoint_every=checkpoint_every, checkpoints=checkpoints)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float | None = None, initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *,
                        use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, use_gate_in_kernel: bool = False,
                        A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                        lower_bound: float | None = None, safe_gate: bool = False,
                        transpose_state_layout: bool = False, state_v_first: bool = False, chunk_size: int = 32,
                        backend: str = "auto", cu_seqlens_cpu: torch.Tensor | None = None,
                        chunk_indices: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                        intermediate_states: torch.Tensor | None = None,
                        state_scales: torch.Tensor | None = None):
    return run(KDA, "recurrent", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
               lower_bound=lower_bound, safe_gate=safe_gate, transpose_state_layout=transpose_state_layout,
               state_v_first=state_v_first, chunk_size=chunk_size, backend=backend, cu_seqlens_cpu=cu_seqlens_cpu,
               chunk_indices=chunk_indices, state_indices=state_indices,
               intermediate_states=intermediate_states, state_scales=state_scales)


_KDA_EQ = "S_t = (I − β_t k_t k_tᵀ) diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t   (g per channel)"
chunk_kda.__doc__ = _doc("Kimi Delta Attention, chunk form.", _KDA_EQ, _G_CHANNEL, gate_args=_GATE_CHANNEL, cp=True)
fused_recurrent_kda.__doc__ = _doc("Kimi Delta Attention, token-recurrent form (decode).", _KDA_EQ, _G_CHANNEL,
                                   gate_args=_GATE_CHANNEL, pool=True)


# --- DeltaNet ------------------------------------------------------------------------------------

def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     scale: float | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *,
                     use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                     allow_neg_eigval: bool = False, transpose_state_layout: bool = False,
                     state_v_first: bool = False, chunk_size: int = 32, backend: str = "auto",
                     cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                     cp_group=None, state_indices: torch.Tensor | None = None,
                     has_initial_state: torch.Tensor | None = None, checkpoint_every: int | None = None,
                     checkpoints: torch.Tensor | None = None, state_scales: torch.Tensor | None = None):
    if state_indices is not None or state_scales is not None:
        return _serving(chunk_delta_rule, (q, k, v, beta), locals())
    return run(DELTA, "chunk", q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, transpose_state_layout=transpose_state_layout,
               state_v_first=state_v_first, chunk_size=chunk_size, backend=backend, cu_seqlens_cpu=cu_seqlens_cpu,
               chunk_indices=chunk_indices, cp_group=cp_group,
               checkpoint_every=checkpoint_every, checkpoints=checkpoints)


def fused_recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                               scale: float | None = None, initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *,
                               use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                               allow_neg_eigval: bool = False, transpose_state_layout: bool = False,
                               state_v_first: bool = False, chunk_size: int = 32, backend: str = "auto",
                               cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                               state_indices: torch.Tensor | None = None,
                               intermediate_states: torch.Tensor | None = None,
                               state_scales: torch.Tensor | None = None):
    return run(DELTA, "recurrent", q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
               allow_neg_eigval=allow_neg_eigval, transpose_state_layout=transpose_state_layout,
               state_v_first=state_v_first, chunk_size=chunk_size, backend=backend, cu_seqlens_cpu=cu_seqlens_cpu,
               chunk_indices=chunk_indices, state_indices=state_indices,
               intermediate_states=intermediate_states, state_scales=state_scales)


_DELTA_EQ = "S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t   (no decay)"
chunk_delta_rule.__doc__ = _doc("DeltaNet, chunk form.", _DELTA_EQ, cp=True)
fused_recurrent_delta_rule.__doc__ = _doc("DeltaNet, token-recurrent form (decode).", _DELTA_EQ, pool=True)


# --- simple GLA / Mamba2 SSD ---------------------------------------------------------------------

def chunk_simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                     scale: float | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *,
                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                     g_gamma: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None, transpose_state_layout: bool = False,
                     state_v_first: bool = False, chunk_size: int = 32, backend: str = "auto",
                     cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                     cp_group=None, state_indices: torch.Tensor | None = None,
                     has_initial_state: torch.Tensor | None = None, checkpoint_every: int | None = None,
                     checkpoints: torch.Tensor | None = None, state_scales: torch.Tensor | None = None):
    if state_indices is not None or state_scales is not None:
        return _serving(chunk_simple_gla, (q, k, v, g), locals())
    return run(GLA, "chunk", q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               g_gamma=g_gamma, A_log=A_log, dt_bias=dt_bias, transpose_state_layout=transpose_state_layout,
               state_v_first=state_v_first, chunk_size=chunk_size, backend=backend, cu_seqlens_cpu=cu_seqlens_cpu,
               chunk_indices=chunk_indices, cp_group=cp_group,
               checkpoint_every=checkpoint_every, checkpoints=checkpoints)


def fused_recurrent_simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                               scale: float | None = None, initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, *,
                               use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                               g_gamma: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
                               dt_bias: torch.Tensor | None = None, transpose_state_layout: bool = False,
                               state_v_first: bool = False, chunk_size: int = 32, backend: str = "auto",
                               cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                               state_indices: torch.Tensor | None = None,
                               intermediate_states: torch.Tensor | None = None,
                               state_scales: torch.Tensor | None = None):
    return run(GLA, "recurrent", q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
               g_gamma=g_gamma, A_log=A_log, dt_bias=dt_bias, transpose_state_layout=transpose_state_layout,
               state_v_first=state_v_first, chunk_size=chunk_size, backend=backend, cu_seqlens_cpu=cu_seqlens_cpu,
               chunk_indices=chunk_indices, state_indices=state_indices,
               intermediate_states=intermediate_states, state_scales=state_scales)


_GLA_EQ = "S_t = exp(g_t) S_{t−1} + k_t v_tᵀ,   o_t = scale · S_tᵀ q_t   (Mamba2 SSD: q=C, k=B, v=x·dt, g=A·dt, scale=1)"
chunk_simple_gla.__doc__ = _doc("Simple GLA (scalar decay, no delta rule; Mamba2's SSD), chunk form.", _GLA_EQ,
                                _G_SCALAR, beta=False, gate_args=_GATE_GLA, cp=True)
fused_recurrent_simple_gla.__doc__ = _doc("Simple GLA, token-recurrent form (decode).", _GLA_EQ, _G_SCALAR,
                                          beta=False, gate_args=_GATE_GLA, pool=True)
