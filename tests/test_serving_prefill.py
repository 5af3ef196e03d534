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
    inp = make_inputs("gdn", H=1, K=16, V=16, lengths=[130], h0=False)
    with pytest.raises(ValueError, match="checkpoints must be a tensor"):
        _call(inp, "torch", checkpoint_every=64, checkpoints=torch.zeros(3, 1, 16, 16))


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
