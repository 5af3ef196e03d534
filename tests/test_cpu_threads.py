"""The CPU backend's head split over threads (no autograd, several torch threads) is bit-identical
to the single-threaded chunk algorithm, for every family, grouped heads, varlen and a carried state,
and restores the process's torch thread count."""
import pytest
import torch

from chunkwise.reference.chunk import _chunk_forward, chunk_forward
from helpers import FAMILIES, make_inputs


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("fam", list(FAMILIES))
@pytest.mark.parametrize("n_threads, H, HV, lengths", [(2, 2, 4, None), (3, 3, 6, [1, 50, 79]), (4, 2, 2, None)])
def test_head_split_equals_single_thread(fam, n_threads, H, HV, lengths, threads):
    inp = make_inputs(fam, B=2, T=70, H=H, HV=HV, K=16, V=24, lengths=lengths, device="cpu", gate="strong")
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, 0.3, inp.h0, inp.cu_seqlens)
    torch.set_num_threads(1)
    o_ref, s_ref = _chunk_forward(*args, chunk_size=32)
    torch.set_num_threads(n_threads)
    o, s = chunk_forward(*args, chunk_size=32)
    assert torch.get_num_threads() == n_threads
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_autograd_takes_the_single_thread_path(threads):
    inp = make_inputs("gdn", B=1, T=40, H=2, HV=2, K=8, V=8, device="cpu", dtype=torch.float64, requires_grad=True)
    torch.set_num_threads(2)
    o, s = chunk_forward(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.3, inp.h0, None, chunk_size=16, dtype=torch.float64)
    (o.sum() + s.sum()).backward()
    assert inp.q.grad is not None and torch.isfinite(inp.q.grad).all()
