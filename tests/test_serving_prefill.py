"""Prefill into the state pool (state_indices, has_initial_state) and prefix-cache checkpoints
(checkpoint_every, checkpoints) of the chunk ops: equal to the plain op with the states gathered and
scattered by hand, and to running each prefix alone."""
import importlib.util
import pathlib

import pytest
import torch

import chunkwise
from chunkwise import prefill
from helpers import CHUNK_OPS, DEVICE, make_inputs, rel_err

BACKENDS = ["torch", "triton"]
FAMS = list(CHUNK_OPS)
LENGTHS = [70, 5, 130]


def _call(inp, backend, **kw):
    return CHUNK_OPS[inp.fam](*inp.args(), None, kw.pop("initial_state", None), kw.pop("output_final_state", False),
                              inp.cu_seqlens, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fam", FAMS)
def test_pool_prefill_equals_gather_op_scatter(fam, backend):
    inp = make_inputs(fam, H=1, HV=2, K=16, V=16, lengths=LENGTHS + [64], h0=False)
    pool = torch.randn(7, 2, 16, 16, device=DEVICE)
    idx = torch.tensor([4, -1, 1, 6], device=DEVICE)                  # -1: padding, skipped
    new = torch.tensor([True, True, False, True], device=DEVICE)    # sequence 2 is new: starts from zero
    h0 = pool[idx.clamp(min=0)] * new.view(-1, 1, 1, 1)
    o_ref, h_ref = _call(inp, backend, initial_state=h0, output_final_state=True)
    want = pool.clone()
    want[[4, 1, 6]] = h_ref[[0, 2, 3]]
    got = pool.clone()
    o, ret = _call(inp, backend, initial_state=got, output_final_state=True, state_indices=idx,
                   has_initial_state=new)
    assert ret is got
    assert torch.equal(got, want)
    skipped = slice(70, 75)
    assert torch.equal(o[:, skipped], torch.zeros_like(o[:, skipped]))
    keep = torch.ones(o.shape[1], dtype=torch.bool)
    keep[skipped] = False
    assert torch.equal(o[:, keep], o_ref[:, keep])


@pytest.mark.parametrize("transposed", [False, True], ids=["KV", "VK"])
def test_pool_prefill_batched_bf16_pool(transposed):
    inp = make_inputs("gdn", B=3, T=40, H=2, K=16, V=8, h0=False)
    tail = (2, 8, 16) if transposed else (2, 16, 8)
    pool = torch.randn(5, *tail, device=DEVICE).bfloat16()
    idx = torch.tensor([2, 0, 4], device=DEVICE)
    o_ref, h_ref = _call(inp, "torch", initial_state=pool[idx].float(), output_final_state=True,
                         transpose_state_layout=transposed)
    got = pool.clone()
    o, _ = _call(inp, "torch", initial_state=got, state_indices=idx, transpose_state_layout=transposed)
    assert torch.equal(o, o_ref)
    assert torch.equal(got[idx], h_ref.bfloat16())
    assert torch.equal(got[[1, 3]], pool[[1, 3]])


@pytest.mark.parametrize("bad", [[0, 7], [-2, 1], [3, 3]], ids=["past-end", "below-minus-one", "duplicate"])
def test_bad_indices_raise_when_visible(bad):
    inp = make_inputs("gdn", H=1, K=16, V=16, lengths=[10, 20], h0=False)
    pool = torch.randn(7, 1, 16, 16)
    with pytest.raises(ValueError, match="state_indices"):
        _call(inp, "torch", initial_state=pool.clone(), state_indices=torch.tensor(bad))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_indices_on_device_leave_pool_untouched(monkeypatch, backend):
    """Indices the host cannot see (a GPU tensor; simulated here): a bad one never writes outside its
    clamped row, and writes nothing there either; the live sequence is updated as usual."""
    monkeypatch.setattr(prefill, "_host_visible", lambda t: False)
    inp = make_inputs("gdn", H=1, K=16, V=16, lengths=[10, 20, 15], h0=False)
    big = torch.randn(9, 1, 16, 16, device=DEVICE)
    pool = big[1:8]                                   # a view: rows 0 and 8 of `big` lie outside the pool
    idx = torch.tensor([100, 3, -7], device=DEVICE)
    _, h_ref = _call(inp, backend, initial_state=torch.zeros(3, 1, 16, 16, device=DEVICE).index_copy(
        0, torch.tensor([1], device=DEVICE), pool[3:4]), output_final_state=True)
    before = big.clone()
    _call(inp, backend, initial_state=pool, state_indices=idx)
    changed = (big != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [4]                             # pool row 3 only
    assert torch.equal(pool[3], h_ref[1])


def test_pool_refused_with_gradients():
    inp = make_inputs("gdn", H=1, K=16, V=16, lengths=[10, 20], h0=False, requires_grad=True)
    with pytest.raises(RuntimeError, match="state_indices is an inference feature"):
        _call(inp, "torch", initial_state=torch.zeros(4, 1, 16, 16), state_indices=torch.tensor([0, 1]))


def test_checkpoint_slots():
    cu = torch.tensor([0, 130, 135, 263, 327])
    assert chunkwise.checkpoint_slots(cu, 64).tolist() == [0, 2, 2, 4, 5]
    assert chunkwise.checkpoint_slots(cu, 128).tolist() == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        chunkwise.checkpoint_slots(cu, 96)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fam", FAMS)
def test_checkpoints_equal_each_prefix_alone(fam, backend):
    lengths = [130, 64, 20]
    inp = make_inputs(fam, H=1, HV=2, K=16, V=16, lengths=lengths)
    cu = inp.cu_seqlens.cpu()
    slots = chunkwise.checkpoint_slots(cu, 64).tolist()
    ck = torch.full((slots[-1], 2, 16, 16), float("nan"), device=DEVICE)
    o, ht = _call(inp, backend, initial_state=inp.h0, output_final_state=True, checkpoint_every=64,
                  checkpoints=ck, cu_seqlens_cpu=cu)
    o_ref, h_ref = _call(inp, backend, initial_state=inp.h0, output_final_state=True)
    assert rel_err(o, o_ref) < 2e-5 and rel_err(ht, h_ref) < 2e-5
    for n, L in enumerate(lengths):
        for j in range(L // 64):
            a, b = int(cu[n]), int(cu[n]) + 64 * (j + 1)
            part = make_inputs(fam, H=1, HV=2, K=16, V=16, lengths=lengths)
            part.q, part.k, part.v = part.q[:, a:b], part.k[:, a:b], part.v[:, a:b]
            part.g = None if part.g is None else part.g[:, a:b]
            part.beta = None if part.beta is None else part.beta[:, a:b]
            part.cu_seqlens = None
            _, h_prefix = _call(part, backend, initial_state=inp.h0[n:n + 1], output_final_state=True)
            assert rel_err(ck[slots[n] + j], h_prefix[0]) < 2e-5, (n, j)
    # a later request sharing sequence 0's first 64 tokens starts from the checkpoint
    rest = make_inputs(fam, H=1, HV=2, K=16, V=16, lengths=lengths)
    rest.q, rest.k, rest.v = rest.q[:, 64:130], rest.k[:, 64:130], rest.v[:, 64:130]
    rest.g = None if rest.g is None else rest.g[:, 64:130]
    rest.beta = None if rest.beta is None else rest.beta[:, 64:130]
    rest.cu_seqlens = None
    o_rest, h_rest = _call(rest, backend, initial_state=ck[0:1], output_final_state=True)
    assert rel_err(o_rest, o_ref[:, 64:130]) < 2e-5 and rel_err(h_rest[0], h_ref[0]) < 2e-5


def test_checkpoints_with_pool_and_batched():
    inp = make_inputs("kda", B=2, T=128, H=1, K=16, V=16, h0=False)
    pool = torch.randn(3, 1, 16, 16, device=DEVICE)
    idx = torch.tensor([2, 0], device=DEVICE)
    ck = torch.zeros(4, 1, 16, 16, device=DEVICE)
    o_ref, h_ref = _call(inp, "torch", initial_state=pool[idx], output_final_state=True)
    got = pool.clone()
    o, _ = _call(inp, "torch", initial_state=got, state_indices=idx, checkpoint_every=64, checkpoints=ck)
    assert rel_err(o, o_ref) < 2e-5 and rel_err(got[idx], h_ref) < 2e-5
    assert rel_err(ck[[1, 3]], h_ref) < 2e-5       # a length that is a multiple: the last checkpoint is final


def test_checkpoints_buffer_checked():
    """A buffer of the wrong length is named, from the host copy of cu_seqlens (on a GPU: cu_seqlens_cpu; without
    one no sync is made to check it, and the kernel writes no state past the buffer: see the test above)."""
    inp = make_inputs("gdn", H=1, K=16, V=16, lengths=[130], h0=False)
    with pytest.raises(ValueError, match="checkpoints must be a tensor"):
        _call(inp, "torch", checkpoint_every=64, checkpoints=torch.zeros(3, 1, 16, 16, device=DEVICE),
              cu_seqlens_cpu=inp.cu_seqlens.cpu())


def test_serving_example_runs_on_cpu():
    path = pathlib.Path(__file__).parents[1] / "examples" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(device="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_pool_prefill_8bit_pool(qdtype, backend):
    """An 8-bit pool: rows read dequantized, written requantized (the decode op's format)."""
    from chunkwise.reference.recurrent import dequantize, quantize
    inp = make_inputs("gdn", H=1, HV=2, K=16, V=16, lengths=[70, 20], h0=False)
    pool, scales = quantize(torch.randn(4, 2, 16, 16, device=DEVICE), qdtype)
    idx = torch.tensor([3, 1], device=DEVICE)
    _, h_ref = _call(inp, backend, initial_state=dequantize(pool[idx.tolist()], scales[idx]), output_final_state=True)
    want_pool, want_scales = quantize(h_ref, qdtype)
    got, got_scales = pool.clone(), scales.clone()
    _call(inp, backend, initial_state=got, state_indices=idx, state_scales=got_scales)
    for r, n in ((3, 0), (1, 1)):
        assert torch.equal(got[r].view(torch.uint8), want_pool[n].view(torch.uint8)), r
        assert torch.equal(got_scales[r], want_scales[n])
    for r in (0, 2):
        assert torch.equal(got[r].view(torch.uint8), pool[r].view(torch.uint8)) and torch.equal(got_scales[r], scales[r])


# --- checkpoints from the stage-2 kernel, in each of its forms -----------------------------------------------------

import dataclasses  # noqa: E402

from chunkwise.reference.recurrent import recurrent_forward  # noqa: E402
from chunkwise.triton.chunk import chunk_fwd as triton_chunk_fwd  # noqa: E402
from chunkwise.triton.common import padded_dims  # noqa: E402
from chunkwise.triton.configs import forward_plan  # noqa: E402

GATE_KIND = {"gdn": 1, "kda": 2, "delta": 0, "gla": 1}


def _prefix_states(inp, every):
    """Each sequence's state after every whole ``every`` tokens, from the float64 token recurrence on the prefix
    alone (packed as checkpoint_slots says): [n, HV, K, V]."""
    if inp.cu_seqlens is None:
        bounds = [(b, 0, inp.q.shape[1]) for b in range(inp.q.shape[0])]
    else:
        cu = inp.cu_seqlens.tolist()
        bounds = [(0, a, b) for a, b in zip(cu[:-1], cu[1:])]
    out = []
    for n, (b, lo, hi) in enumerate(bounds):
        for j in range((hi - lo) // every):
            cut = [None if x is None else x[b:b + 1, lo:lo + every * (j + 1)].double()
                   for x in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
            h0 = None if inp.h0 is None else inp.h0[n:n + 1].double()
            out.append(recurrent_forward(*cut, inp.q.shape[-1] ** -0.5, h0)[1][0])
    return torch.stack(out)


FORMS = {   # name: (family, make_inputs kwargs, plan fields, every)
    "gdn-varlen": ("gdn", dict(H=1, HV=2, K=16, V=16, lengths=[130, 64, 20, 200]), {}, 64),
    "kda-varlen-every128": ("kda", dict(H=1, HV=2, K=16, V=16, lengths=[300, 127, 128]), {}, 128),
    "delta-trans": ("delta", dict(B=2, T=130, H=1, K=16, V=64), dict(trans=True, bv=64), 64),
    "gla-segments": ("gla", dict(B=1, T=260, H=1, HV=2, K=16, V=16), dict(segments=3), 64),
    "gdn-padded-K20": ("gdn", dict(H=1, HV=2, K=20, V=12, lengths=[70, 135]), {}, 64),
    "kda-split-asked": ("kda", dict(H=1, HV=2, K=16, V=16, lengths=[330, 64]), dict(delta_split=2), 64),
    "gdn-fp16-beside-stage1": ("gdn", dict(H=1, HV=2, K=32, V=32, lengths=[200, 10, 64], dtype=torch.float16),
                               dict(overlap=1), 64),
}


@pytest.mark.parametrize("transpose", [False, True], ids=["KV", "VK"])
@pytest.mark.parametrize("form", list(FORMS))
def test_kernel_checkpoints_equal_each_prefix_alone(form, transpose):
    """The stage-2 kernel's stores (varlen, lengths not multiples of every, a sequence shorter than every; the
    transposed step, simple GLA's segments, padded head dims, stage 2 beside stage 1; a plan asking for the delta
    families' sequence split, which checkpoints run unsplit): the float64 recurrence over each prefix alone. Outputs
    and final states as without checkpoints (within fp32 rounding where those split)."""
    fam, kw, fields, every = FORMS[form]
    inp = make_inputs(fam, **kw)
    K, V = padded_dims(inp.q, inp.v)
    plan = dataclasses.replace(forward_plan(inp.q.device, inp.q.dtype, GATE_KIND[fam], inp.beta is not None, K, V),
                               **fields)
    cu = inp.cu_seqlens if inp.cu_seqlens is not None else \
        torch.arange(inp.q.shape[0] + 1, dtype=torch.int32) * inp.q.shape[1]
    slots = chunkwise.checkpoint_slots(cu, every).to(DEVICE)
    HV_, K_, V_ = inp.v.shape[2], inp.q.shape[3], inp.v.shape[3]
    ck = torch.full((int(slots[-1]), HV_, *((V_, K_) if transpose else (K_, V_))), float("nan"), device=DEVICE)
    h0 = None if inp.h0 is None else (inp.h0.transpose(-1, -2).contiguous() if transpose else inp.h0)
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, K_ ** -0.5, h0, True, inp.cu_seqlens)
    o, ht = triton_chunk_fwd(*args, transpose_state_layout=transpose, plan=plan, checkpoints=(ck, slots, every))
    o0, ht0 = triton_chunk_fwd(*args, transpose_state_layout=transpose, plan=plan)
    if "split" in form:
        assert rel_err(o, o0) < 2e-5 and rel_err(ht, ht0) < 2e-5
    else:
        assert torch.equal(o, o0) and torch.equal(ht, ht0)
    got = ck.transpose(-1, -2) if transpose else ck
    want = _prefix_states(inp, every)
    tol = 2e-3 if inp.q.dtype == torch.float16 else 2e-5
    assert rel_err(got, want) < tol
    for j in range(got.shape[0]):
        assert rel_err(got[j], want[j]) < tol, j


def test_kernel_checkpoints_never_write_past_the_buffer():
    """A buffer one checkpoint short (its length unchecked: lengths on the device only): the kernel writes the slots
    that fit and nothing past them (NaN guard rows on both sides stay NaN)."""
    inp = make_inputs("gdn", H=1, HV=2, K=16, V=16, lengths=[130, 200], h0=False)
    slots = chunkwise.checkpoint_slots(inp.cu_seqlens, 64)          # [0, 2, 5]
    guarded = torch.full((int(slots[-1]) + 1, 2, 16, 16), float("nan"), device=DEVICE)
    ck = guarded[1:-1]                                               # 4 of the 5 slots
    triton_chunk_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.25, None, False, inp.cu_seqlens,
                     checkpoints=(ck, slots.to(DEVICE), 64))
    assert torch.isnan(guarded[0]).all() and torch.isnan(guarded[-1]).all()
    assert rel_err(ck, _prefix_states(inp, 64)[:4]) < 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_dense_batch_transposed_every128(backend):
    """The public op: a dense batch, the [.., V, K] layout, every = 128, without a pool."""
    inp = make_inputs("gla", B=2, T=300, H=1, HV=2, K=16, V=16)
    ck = torch.full((4, 2, 16, 16), float("nan"), device=DEVICE)
    h0 = inp.h0.transpose(-1, -2).contiguous()
    with torch.no_grad():
        o, ht = _call(inp, backend, initial_state=h0, output_final_state=True, transpose_state_layout=True,
                      checkpoint_every=128, checkpoints=ck)
        o_ref, h_ref = _call(inp, backend, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    assert rel_err(o, o_ref) < 2e-5 and rel_err(ht, h_ref) < 2e-5
    assert rel_err(ck.transpose(-1, -2), _prefix_states(inp, 128)) < 2e-5


def test_checkpoints_argument_checks():
    inp = make_inputs("gdn", H=1, K=16, V=16, lengths=[130], h0=False)
    ck = torch.zeros(2, 1, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive multiple"):
        _call(inp, "torch", checkpoint_every=96, checkpoints=ck)
    with pytest.raises(ValueError, match="go together"):
        _call(inp, "torch", checkpoints=ck)
    with pytest.raises(ValueError, match="contiguous float tensor"):
        _call(inp, "torch", checkpoint_every=64, checkpoints=torch.zeros(2, 1, 8, 16, device=DEVICE))
    grad = make_inputs("gdn", H=1, K=16, V=16, lengths=[130], h0=False, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference feature"):
        _call(grad, "torch", checkpoint_every=64, checkpoints=ck)
    with pytest.raises(ValueError, match="not available with cp_group"):
        _call(inp, "torch", checkpoint_every=64, checkpoints=ck, cp_group=object())


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_opcheck_and_compile(backend):
    """chunkwise::chunk_fwd_checkpoints: opcheck (checkpoints mutated), and the public op with checkpoints under
    torch.compile(fullgraph=True) writes what eager writes."""
    from chunkwise import _custom_ops
    inp = make_inputs("kda", H=1, HV=2, K=16, V=16, lengths=[130, 70], h0=False)
    slots = chunkwise.checkpoint_slots(inp.cu_seqlens, 64)
    ck = torch.zeros(3, 2, 16, 16, device=DEVICE)
    torch.library.opcheck(_custom_ops.chunk_fwd_checkpoints,
                          (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.25, None, True, inp.cu_seqlens, None, False, 32,
                           backend, ck, slots, 64))

    def prefill(q, k, v, g, beta, cu, ck):
        return chunkwise.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, checkpoint_every=64, checkpoints=ck,
                                   backend=backend)[0]

    torch._dynamo.reset()
    compiled = torch.compile(prefill, fullgraph=True, backend="aot_eager")
    ck1, ck2 = torch.zeros_like(ck), torch.zeros_like(ck)
    with torch.no_grad():
        o1 = compiled(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_seqlens, ck1)
        o2 = prefill(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_seqlens, ck2)
    assert torch.equal(o1, o2) and torch.equal(ck1, ck2) and rel_err(ck1, _prefix_states(inp, 64)) < 2e-5


def test_bench_forward_checkpoint_every(tmp_path, capsys):
    """bench_forward.py --checkpoint-every: each row also timed with checkpoints, outputs unchanged by them."""
    import json
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    import bench_forward
    rc = bench_forward.main(["--device", "cpu", "--dtype", "fp32", "--no-peers", "--ops", "gdn", "--out", str(tmp_path),
                             "--commit", "x", "--shapes", "varlen3-T130-H2-HV4-K32", "--checkpoint-every", "64"])
    assert rc == 0 and "| ckpt ms | ckpt +% | ckpt MB |" in capsys.readouterr().out
    row = json.load(open(tmp_path / "bench_forward.json"))["rows"][0]
    assert row["ckpt_ms"] > 0 and row["o_vs_no_ckpt"] == 0 and row["ckpt_MB"] * 1e6 == 1 * 4 * 32 * 32 * 4  # 70 >= 64
