"""What every Triton kernel of the chunk algorithm shares: the constants, the @triton.jit helpers of both
directions (exponentials, products at a precision, the chunk a program owns, the ready flags of two stages
running side by side) and the host helpers of the launchers (allocation, padding, the device and target).

The algorithm and its numerics are described in docs/design.md.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BT = 64          # chunk length
BC = 16          # sub-block of the triangular solve and of the per-channel factorisation
# Per-token gate clamp (NaN passes through): e^-40 is 11 orders under fp32's resolution, so the recurrence cannot
# tell the clamp from the true gate, while a hard reset (g = -1e4) would otherwise cost the fp32 cumulative sums
# after it ~3 digits when differenced.
G_FLOOR = -40.0
SPAN_MAX = 80.0  # the largest |exponent| of a gate factor; a 16-token block whose gates sum below -2 SPAN_MAX goes exact
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Every gate factor e^x as one ex2.approx.ftz.f32 of x·log2(e): tl.exp's ex2.approx.f32 handles subnormal results
# with a compare and predicated multiplies around the same instruction, for factors under 2^-126 that multiply a
# term out of every 16-bit output's reach. The interpreter runs no PTX: tl.exp there.
FAST_EXP = tl.constexpr(not INTERPRET)
_LOG2E = tl.constexpr(1.4426950408889634)


# ------------------------------------------------------------------------------------------------
# @triton.jit helpers
# ------------------------------------------------------------------------------------------------

@triton.jit
def _exp_or(x, FAST: tl.constexpr):
    """e^x of an fp32 tile or scalar: FAST, ex2.approx.ftz.f32 of x·log2(e); else tl.exp."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * _LOG2E], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def _exp(x):
    """e^x of an fp32 tile or scalar (FAST_EXP: _exp_or's ex2.approx.ftz.f32)."""
    return _exp_or(x, FAST_EXP)


@triton.jit
def _and(mask, ok):
    """mask & ok for a tile mask and a scalar condition (triton 3.9's interpreter rejects the `&` of the two)."""
    return tl.where(ok, mask, False)


@triton.jit
def _finite(x):
    """Where x is finite (a NaN compares false, an inf is not below inf)."""
    return tl.abs(x) < float("inf")


@triton.jit
def _finite_or_zero(x):
    """x with its non-finite elements replaced by 0 (same dtype)."""
    return tl.where(_finite(x), x, tl.zeros_like(x))


@triton.jit
def _first_bad_row(x, BTc: tl.constexpr):
    """The first row of the tile x [BTc, C] holding a non-finite element (BTc if none)."""
    o_t = tl.arange(0, BTc)
    return tl.min(tl.where(tl.max(tl.where(_finite(x), 0, 1), 1) > 0, o_t, BTc), 0)


@triton.jit
def _chunk_cut(nf, slot0, i_t, c1, i_h, HV, BTc: tl.constexpr):
    """Chunk i_t's first row with a non-finite k, v, g or β (stage 1's nf [slots, HV] int32; BTc where none, and past
    c1). Loaded a chunk ahead by the serial loops, like _chunk_decay's decay."""
    return tl.load(nf + (slot0 + i_t) * HV + i_h, mask=i_t < c1, other=BTc)


@triton.jit
def _first_cut(nf, slot0, c0, c1, i_h, HV, BTc: tl.constexpr, BLOCK: tl.constexpr = 256):
    """The smallest of chunks c0 .. c1 − 1's cuts in stage 1's nf [slots, HV] (BTc if none)."""
    f = tl.full([], BTc, tl.int32)
    i0 = tl.full([], 0, tl.int32) + c0
    while i0 < c1:      # (not range(): the triton 3.6 interpreter takes no tensor bound there)
        o_c = i0 + tl.arange(0, BLOCK)
        f = tl.minimum(f, tl.min(tl.load(nf + (slot0 + o_c) * HV + i_h, mask=o_c < c1, other=BTc), 0))
        i0 += BLOCK
    return f


@triton.jit
def _tile_ptrs(x, base, row_stride, r0, c0, R: tl.constexpr, C: tl.constexpr):
    """(pointers, row indices [R], column indices [C]) of rows r0 .. r0 + R − 1, columns c0 .. c0 + C − 1 of the
    row-major matrix at x + base (row stride row_stride). The tile's first row in int64 (token rows times H·K pass
    2^31 on long batches), the offsets inside the tile in int32."""
    o_r = tl.arange(0, R)
    o_c = c0 + tl.arange(0, C)
    ptr = x + base + r0.to(tl.int64) * row_stride
    return ptr + o_r[:, None] * row_stride + o_c[None, :], r0 + o_r, o_c


@triton.jit
def _tile_load(x, base, n_rows, n_cols, row_stride, r0, c0, R: tl.constexpr, C: tl.constexpr, CHK_R: tl.constexpr,
               CHK_C: tl.constexpr):
    """The [R, C] tile at rows r0, columns c0 of the [n_rows, n_cols] matrix at x + base (_tile_ptrs), zero outside
    it; only the rows (CHK_R) and the columns (CHK_C) asked for are bounds-checked (the others are known inside)."""
    p, o_r, o_c = _tile_ptrs(x, base, row_stride, r0, c0, R, C)
    if CHK_R and CHK_C:
        t = tl.load(p, mask=(o_r < n_rows)[:, None] & (o_c < n_cols)[None, :], other=0.)
    elif CHK_R:
        t = tl.load(p, mask=(o_r < n_rows)[:, None], other=0.)
    elif CHK_C:
        t = tl.load(p, mask=(o_c < n_cols)[None, :], other=0.)
    else:
        t = tl.load(p)
    return t


@triton.jit
def _tile_store(x, base, n_rows, n_cols, row_stride, r0, c0, val, R: tl.constexpr, C: tl.constexpr,
                CHK_R: tl.constexpr, CHK_C: tl.constexpr):
    """val [R, C] (converted to x's dtype) into the tile _tile_load reads; nothing outside the matrix written."""
    p, o_r, o_c = _tile_ptrs(x, base, row_stride, r0, c0, R, C)
    val = val.to(x.dtype.element_ty)
    if CHK_R and CHK_C:
        tl.store(p, val, mask=(o_r < n_rows)[:, None] & (o_c < n_cols)[None, :])
    elif CHK_R:
        tl.store(p, val, mask=(o_r < n_rows)[:, None])
    elif CHK_C:
        tl.store(p, val, mask=(o_c < n_cols)[None, :])
    else:
        tl.store(p, val)


@triton.jit
def _row_of(x, r: tl.constexpr, BTc: tl.constexpr):
    """Row r of x [BT, D] as [D] (exact: a masked sum of one term)."""
    o_t = tl.arange(0, BTc)
    return tl.sum(tl.where((o_t == r)[:, None], x, 0.), 0)


@triton.jit
def _by_block(v0, v1, v2, v3, BTc: tl.constexpr, BCc: tl.constexpr):
    """[BT, D] tile whose rows in 16-row block b are v_b [D] (or scalars)."""
    blk = (tl.arange(0, BTc) // BCc)[:, None]
    return tl.where(blk == 0, v0, tl.where(blk == 1, v1, tl.where(blk == 2, v2, v3)))


@triton.jit
def _rn_tf32(x):
    """fp32 rounded to the nearest tf32 (10-bit mantissa, ties away from zero); other dtypes as they are. The
    tensor cores truncate fp32 operands toward zero, a bias that adds up over long sums (triton#4574)."""
    if x.dtype == tl.float32:
        return ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _mm_acc(acc, a, b, MM_PREC: tl.constexpr):
    """acc + a @ b at _mm's product precision, accumulated into acc by the product itself (acc None: a @ b): no
    second [M, P] accumulator is live, as it is for ``acc + _mm(a, b)`` where the compiler cannot fold the sum into
    the product."""
    if MM_PREC == "tf32rn":
        return tl.dot(_rn_tf32(a), _rn_tf32(b), acc=acc, input_precision="tf32")
    elif MM_PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc=acc)
    elif MM_PREC == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc=acc)
    else:
        return tl.dot(a, b, acc=acc, input_precision=MM_PREC)


@triton.jit
def _mm(a, b, MM_PREC: tl.constexpr):
    """tl.dot at a product precision (the forward's fp32 factor products and solve, every product of the backward):
    MM_PREC "tf32" / "tf32x3" / "ieee" as tl.dot takes them, "tf32rn": tf32 with fp32 operands rounded to nearest
    first, or "bf16" / "fp16": both operands rounded to that type (fp32 accumulation; fp16 overflows past 65504 to
    inf). 16-bit operands go to the tensor cores as they are at any setting."""
    return _mm_acc(None, a, b, MM_PREC)


@triton.jit
def _chunk_span(i_t, i_b, cu_seqlens, chunk_indices, T, NT, BTc: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program i_t of batch row i_b of the chunk-parallel kernels -> (bos, T_seq, t0, slot): the
    sequence's first token row, its length, the chunk's first token in it, and the chunk's slot in
    per-chunk buffers (n·NT + i, or n + start_token // 64 with cu_seqlens)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        slot = i_n + (bos + i_c * BTc) // BTc
    else:
        i_c = i_t.to(tl.int64)
        bos = i_b.to(tl.int64) * T
        eos = bos + T
        slot = i_b.to(tl.int64) * NT + i_c
    return bos, (eos - bos).to(tl.int32), (i_c * BTc).to(tl.int32), slot


@triton.jit
def _signal_ready(ready, slot, i_h, HV):
    """Stage 1 beside stage 2 (SIGNAL): publish this program's chunk. Every thread's stores first (the barrier),
    then one release write of 1 to ready[slot, head], which stage 2's acquire reads (_wait_ready)."""
    tl.debug_barrier()
    tl.atomic_xchg(ready + slot * HV + i_h, 1, sem="release", scope="gpu")


# stage 2's spin on a chunk's ready flag (_wait_ready) as one PTX loop of acquire loads, so that the chunk loop it sits
# in stays Triton's innermost loop (with a Triton while loop nested in it, the loop was not software-pipelined: offline
# sm_90 its tile loads became plain LDG and its shared memory fell from 168 KB to 53 KB); with FENCE a proxy fence
# after it, for the tensor-descriptor (async proxy) loads that follow
_SPIN_PTX = ("{\n.reg .pred %spin_p;\nSPIN_${:uid}:\nld.acquire.gpu.global.b32 $0, [$1];\nsetp.eq.s32 %spin_p, $0, 0;\n"
             "@%spin_p bra SPIN_${:uid};\n}")
_SPIN = tl.constexpr(_SPIN_PTX)
_SPIN_FENCE = tl.constexpr(_SPIN_PTX + "\nfence.proxy.async.global;")


@triton.jit
def _wait_ready(ready, slot, i_h, HV, FENCE: tl.constexpr, SPIN_ASM: tl.constexpr):
    """Stage 2 beside stage 1 (WAIT): spin until stage 1 has published chunk ``slot`` of head i_h (acquire: the
    loads after it see stage 1's stores). SPIN_ASM: the loop in PTX (_SPIN; compiled), else a Triton loop of
    atomic reads (the interpreter). FENCE: the loads that follow go through tensor descriptors (the async proxy)."""
    flag = ready + slot * HV + i_h
    if SPIN_ASM:
        if FENCE:
            tl.inline_asm_elementwise(_SPIN_FENCE, "=r,l", [flag], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_SPIN, "=r,l", [flag], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        while r == 0:
            r = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")



# ------------------------------------------------------------------------------------------------
# host helpers of the launchers
# ------------------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host arithmetic (``triton.cdiv`` is a constexpr function whose wrapper costs
    microseconds a call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as ``triton.next_power_of_2`` without its host cost."""
    return 1 << (n - 1).bit_length()


def _dim(n: int) -> int:
    """The tile width of a head dim of n channels: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_pow2(n))


def gate_kind(g) -> int:
    """0 no gate, 1 a scalar gate per token and head ([B, T, HV]), 2 one per channel ([B, T, HV, K], KDA)."""
    return 0 if g is None else (1 if g.dim() == 3 else 2)


def chunk_slots(N: int, T: int, varlen: bool) -> int:
    """Per-chunk slots of a batch (stage 1's glast, read by stage 2; the backward's per-chunk states h): N·⌈T / BT⌉
    for N sequences of T tokens, N + T // BT for N packed ones of T tokens in all (sequence n's chunks at
    n + bos_n // BT + [0, chunks), as _chunk_span numbers them: distinct across sequences, known from the shapes
    alone)."""
    return N + T // BT if varlen else N * cdiv(T, BT)


def chunks_whole(T: int, varlen: bool) -> bool:
    """Whether every chunk of a launch is BT rows long: no varlen and T a multiple of BT (then the tiles need no row
    bounds checks)."""
    return not varlen and T % BT == 0


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-chunk states and R kept between passes (the backward's h, dh, R, dR, W, U; the saved
    ones): the input dtype when it is 16-bit (as fla keeps h, w, u, v_new), else fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def on_tensor_device(fn):
    """Run a launcher with the CUDA current device set to its first argument's device. Triton launches on the
    current device (and its current stream): without this, tensors on cuda:1 while cuda:0 is current would be
    handed to kernels running on cuda:0. A no-op for CPU tensors (the interpreter) and when the device is current."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        x = args[0]
        if isinstance(x, torch.Tensor) and x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapped


def _poison() -> bool:
    """CHUNKWISE_POISON=1 (tests) pre-fills every tensor the launchers allocate with NaN, so that an element a kernel
    should have written but did not shows up in the results."""
    return os.environ.get("CHUNKWISE_POISON") == "1"


def _alloc(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device) if _poison() else \
        torch.empty(shape, dtype=dtype, device=device)


def target_arch(device: torch.device) -> int | None:
    """The CUDA architecture the kernels are built for (major·10 + minor), which picks the launch plans: the
    device's for CUDA tensors; sm_90's under the interpreter (CI runs the paths the H100 / H200 take) and where
    Triton's active driver targets CUDA from CPU tensors (an offline PTX build); None where nothing is built for a
    GPU."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    if INTERPRET:
        return 90
    try:
        target = triton.runtime.driver.active.get_current_target()
    except Exception:       # no GPU driver at all
        return None
    return int(target.arch) if target.backend == "cuda" and isinstance(target.arch, int) else None


def builds_for_gpu(device: torch.device) -> bool:
    """Whether launches on ``device`` compile real kernels for a GPU (not the interpreter's Python)."""
    return not INTERPRET and target_arch(device) is not None


def _num_sms(device: torch.device) -> int:
    """SMs of the device (132, an H100 / H200's, off CUDA: the grid choices then follow the GPU that the interpreter
    and the offline builds stand in for)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _overlap(programs: int, n_sm: int, n_chunks: int, device: torch.device) -> bool:
    """Whether a serial pass of ``programs`` can run beside a chunk-parallel launch that publishes its chunks (ready
    flags): fewer programs than SMs (the spinning programs must leave the other launch an SM), at most 65535 chunks
    (the chunk-major grid puts them on grid axis 1), and a target to build for."""
    return 0 < n_chunks <= 65535 and programs < n_sm and target_arch(device) is not None


def _serial_first(programs: int, n_sm: int) -> bool:
    """Whether the serial pass beside a chunk-parallel launch is placed on the GPU before it (the launch then goes on
    a normal-priority stream of its own): where the pass takes at most half the SMs. Both launches are made ready
    by the same event, and the GPU starts whichever it takes first: the caller's stream's next launch (eager) or the
    higher priority (in a CUDA graph). Placed after the launch's first wave, the pass waits for SMs to empty; placed
    first on more than half the SMs, it leaves the launch too few."""
    return 2 * programs <= n_sm


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device, high: bool = True):
    """A stream per device and priority for work beside the caller's stream, made to wait for that stream's work so
    far. ``high``: the serial pass beside a chunk-parallel launch (stage 2 beside stage 1, the backward's forward
    state pass beside its W / U launch): its programs are placed as soon as the launch's programs leave room, ahead
    of its later ones. Else normal priority: the chunk-parallel launch where the serial pass goes first. None off
    CUDA (the interpreter, offline builds: launches run one after the other)."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if (idx, high) not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx, high] = torch.cuda.Stream(device=idx, priority=-1 if high else 0)
    side = _SIDE_STREAMS[idx, high]
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _torch_scratch(size: int, alignment: int, stream):
    """Triton's scratch memory for tensor descriptors made inside a kernel, from torch's caching allocator (on the
    current device, where Triton launches; capture-safe under CUDA graphs)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator():
    """Tensor descriptors made inside a kernel need Triton's scratch allocator: ours (_torch_scratch) unless the
    caller has set their own."""
    try:
        from triton.runtime import _allocation
        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):       # a triton without this internal: set ours
        unset = True
    if unset:
        triton.set_allocator(_torch_scratch)


# ------------------------------------------------------------------------------------------------
# zero-padding of head dims the kernels do not take as they are
# ------------------------------------------------------------------------------------------------
# With 16-bit inputs a head dim that is not a power of two is padded up to the next one (on sm_90 with triton 3.6,
# K = 100 / V = 60 gave wrong outputs or illegal memory accesses, also at 104 / 64, while 64 and 128 were right);
# with fp32 a head dim whose rows are not whole 16-byte units is padded to one that is. The results are cut back.
# Zero channels change nothing: q·k is unchanged, the state's extra rows and columns stay zero, a zero gate is
# e^0 = 1, and the gradients of the padded channels are dropped.

def aligned_dim(n: int, element_size: int) -> int:
    """The head dim the kernels run with for n channels of element_size bytes: the next power of two (at least 16)
    for 16-bit inputs, else n rounded up to whole 16-byte units."""
    if element_size <= 2:
        return max(16, next_pow2(n))
    unit = max(1, 16 // element_size)
    return cdiv(n, unit) * unit


def padded_dims(q, v) -> tuple[int, int]:
    """(K', V') the kernels run with for q [.., K] and v [.., V]."""
    return aligned_dim(q.shape[-1], q.element_size()), aligned_dim(v.shape[-1], v.element_size())


def pad_last(x, n: int):
    """x zero-padded along its last dim to n (x itself when already n; None stays None)."""
    return x if x is None or x.shape[-1] == n else F.pad(x, (0, n - x.shape[-1]))


def pad_state(s, K: int, V: int, transposed: bool):
    """A state [N, HV, K0, V0] ([N, HV, V0, K0] transposed) zero-padded to K × V."""
    if s is None:
        return None
    rows, cols = (V, K) if transposed else (K, V)
    if tuple(s.shape[-2:]) == (rows, cols):
        return s
    return F.pad(s, (0, cols - s.shape[-1], 0, rows - s.shape[-2]))


def cut_state(s, K: int, V: int, transposed: bool):
    """The K × V corner of a padded state, contiguous (None stays None)."""
    if s is None:
        return None
    return (s[..., :V, :K] if transposed else s[..., :K, :V]).contiguous()
