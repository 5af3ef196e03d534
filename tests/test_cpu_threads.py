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


def _child_run(queue):
    torch.set_num_threads(2)
    inp = make_inputs("gdn", B=1, T=40, H=2, HV=2, K=8, V=8, device="cpu")
    o, _ = chunk_forward(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.3, inp.h0, None, chunk_size=16)
    queue.put(bool(torch.isfinite(o).all()))


def test_forked_child_gets_its_own_thread_pool(threads):
    """The head split keeps a thread pool across calls; a forked child (a DataLoader worker) must not
    hand work to the parent's threads, which it does not have (that would hang)."""
    import multiprocessing as mp
    torch.set_num_threads(2)
    inp = make_inputs("gdn", B=1, T=40, H=2, HV=2, K=8, V=8, device="cpu")
    chunk_forward(inp.q, inp.k, inp.v, inp.g, inp.beta, 0.3, inp.h0, None, chunk_size=16)   # parent's pool
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_run, args=(queue,))
    child.start()
    child.join(60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, "the forked child hung on the parent's thread pool"
    assert child.exitcode == 0 and queue.get(timeout=5)
