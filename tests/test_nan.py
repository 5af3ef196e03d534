"""Non-finite inputs: a NaN or inf in one token's input reaches that token and the later ones of its
sequence, never an earlier token nor another sequence, as in the token recurrence.

The chunk forms contract whole chunks with lower-triangular matrices, where 0 · NaN = NaN would carry a
later token's NaN into the earlier rows; each test compares the tokens before the non-finite one with a
run on finite inputs, on both backends (Triton under the interpreter on the CPU).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from helpers import CHUNK_OPS, FAMILIES, RECURRENT_OPS, make_inputs, reference, rel_err

# the Triton interpreter's numpy products meet the NaN and inf on purpose here
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:All-NaN slice encountered:RuntimeWarning")

FAMS = list(FAMILIES)
INPUTS = ("q", "k", "v", "g", "beta")
# (NaN for every input; "inf" is -inf for the log-space gate, a decay of exactly zero, and +inf elsewhere)
BAD = {"nan": float("nan"), "inf": float("inf")}

def poisoned(inp, which, t, bad, row=0):
    """A copy of inp whose input ``which`` holds ``bad`` at token t of batch row ``row`` (every head, channel)."""
    x = getattr(inp, which).clone()
    x[row, t] = -BAD[bad] if which == "g" and bad == "inf" else BAD[bad]
    return dataclasses.replace(inp, **{which: x})


def run(op, inp, backend):
    return op(*inp.args(), initial_state=inp.h0, output_final_state=True, cu_seqlens=inp.cu_seqlens,
              backend=backend)


def _params():
    for backend in ("torch", "triton"):
        for fam in FAMS:
            for which in INPUTS:
                if (which == "g" and FAMILIES[fam].gate == "none") or (which == "beta" and not FAMILIES[fam].delta):
                    continue
                for bad in BAD:
                    # (the torch chunk is 32 tokens, Triton's 64: 50 lies inside a chunk for both)
                    for t in ((1, 50, 99) if backend == "torch" and bad == "nan" else (50,)):
                        yield pytest.param(backend, fam, which, bad, t, id=f"{backend}-{fam}-{which}-{bad}-t{t}")


@functools.lru_cache(maxsize=None)
def clean_run(backend, fam):
    """The inputs of the test below and the op's output on them (the same for each poisoned input)."""
    inp = make_inputs(fam, B=2, T=100, H=1, HV=2, K=16, V=16, dtype=torch.float32)
    return inp, run(CHUNK_OPS[fam], inp, backend)[0]


@pytest.mark.parametrize("backend,fam,which,bad,t", list(_params()))
def test_nonfinite_input_reaches_no_earlier_token(backend, fam, which, bad, t):
    inp, o_clean = clean_run(backend, fam)
    bad_inp = poisoned(inp, which, t, bad, row=1)
    o, ht = run(CHUNK_OPS[fam], bad_inp, backend)
    # the tokens before t, and every token of the other sequence, as with finite inputs (the products meet the
    # later tokens only through exact zeros: the same bits)
    where = f"first non-finite at {(~torch.isfinite(o[1])).flatten(1).any(1).nonzero()[:1].tolist()}"
    if backend == "triton" and fam == "kda" and which == "g":
        # (Triton's KDA factors e^{G_i − G_j} around the chunk's last gate, which the poisoned gate changes: the
        # earlier tokens' products are rounded otherwise, not NaN)
        assert torch.isfinite(o[1, :t]).all() and rel_err(o[1, :t], o_clean[1, :t]) < 1e-5, where
    else:
        assert torch.equal(o[1, :t], o_clean[1, :t]), f"tokens before {t} changed: {where}"
    assert torch.equal(o[0], o_clean[0]) and torch.isfinite(ht[0]).all()
    # and a non-finite value is never hidden: where the float64 recurrence's output is non-finite, so is this one
    row1 = dataclasses.replace(bad_inp, **{n: None if x is None else x[1:] for n, x in vars(bad_inp).items()
                                           if n not in ("fam", "cu_seqlens")})
    o_ref = reference(row1)[0][0]
    assert (~torch.isfinite(o[1]) | torch.isfinite(o_ref)).all(), "a non-finite output of the recurrence came out finite"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fam", FAMS)
def test_nonfinite_input_varlen(fam, backend):
    """Packed sequences: a NaN in the second sequence leaves the first alone and its own earlier tokens too."""
    lengths = [70, 90]
    inp = make_inputs(fam, lengths=lengths, H=1, K=16, V=16, dtype=torch.float32)
    o_clean, h_clean = run(CHUNK_OPS[fam], inp, backend)
    t = 70 + 40
    bad_inp = poisoned(inp, "v", t, "nan")
    o, ht = run(CHUNK_OPS[fam], bad_inp, backend)
    assert torch.equal(o[0, :t], o_clean[0, :t])
    assert torch.equal(ht[0], h_clean[0])
    assert o[0, t:].isnan().any(-1).all() and ht[1].isnan().any()


# the Triton forward's other forms, by plan (the defaults above take the plain step at a 16-wide value block, the T
# form, P from stage 1 for GDN / KDA): the transposed step, W / U (the training forward's), P formed the other way,
# stage 2 beside stage 1, the fp16 solve with its redo, the delta families' sequence split, the saving forward (R
# stored for the backward), simple GLA's segments
FORMS = {
    "transposed": dict(bv=64), "transposed-W/U": dict(bv=64, t_form=False), "plain-W/U": dict(bv=32, t_form=False),
    "P-other": dict(bv=32), "beside": dict(overlap=1), "fp16-solve": dict(solve_prec="fp16", redo_split=True),
    "split": dict(delta_split=2), "saving": {}, "segments": dict(segments=2),
}
# (simple GLA: one step, no stage 1 but P; KDA always takes P from stage 1)
FORM_CASES = [(f, form) for f in FAMS for form in FORMS
              if (form in ("segments", "P-other") if f == "gla" else form != "segments" and (f, form) != ("kda", "P-other"))]


@pytest.mark.parametrize("fam,form", FORM_CASES, ids=[f"{f}-{form}" for f, form in FORM_CASES])
def test_nonfinite_input_forms(fam, form):
    """Each form of the Triton forward: a NaN in k, v, g or β at token 150 (the middle of the third chunk; with the
    split, of the second of three segments) leaves the earlier tokens and the other sequence as with finite inputs,
    and makes every later output and the final state NaN."""
    from chunkwise.triton.chunk import chunk_fwd
    from chunkwise.triton.configs import forward_plan

    inp = make_inputs(fam, B=2, T=300 if form == "split" else 200, H=1, HV=2, K=16, V=64, dtype=torch.float32, seed=5)
    spec = FAMILIES[fam]
    fields = dict(FORMS[form])
    if form == "P-other":
        fields["p_in"] = {"delta": True, "gla": True, "gdn": False}[fam]
    gate = {"none": 0, "scalar": 1}.get(spec.gate, 2)
    save = form == "saving"
    plan = dataclasses.replace(forward_plan(inp.q.device, inp.q.dtype, gate, spec.delta, 16, 64, save=save), **fields)

    def fwd(x):
        return chunk_fwd(x.q, x.k, x.v, x.g, x.beta, 0.25, x.h0, True, None, plan=plan, saved_out={} if save else None)

    o_clean, h_clean = fwd(inp)
    t = 150
    for which in ("k", "v", "g", "beta"):
        if getattr(inp, which) is None:
            continue
        o, ht = fwd(poisoned(inp, which, t, "nan", row=1))
        if fam == "kda" and which == "g":       # (see test_nonfinite_input_reaches_no_earlier_token)
            assert torch.equal(o[1, :128], o_clean[1, :128]) and rel_err(o[1, 128:t], o_clean[1, 128:t]) < 1e-5
        else:
            assert torch.equal(o[1, :t], o_clean[1, :t]), f"{which}: tokens before {t} changed"
        assert o[1, t:].isnan().all() and ht[1].isnan().all(), f"{which}: a later output or the state is not NaN"
        assert torch.equal(o[0], o_clean[0]) and torch.equal(ht[0], h_clean[0]), f"{which}: the other sequence"


@pytest.mark.parametrize("fam", FAMS)
def test_nonfinite_input_float64_autograd(fam):
    """The float64 autograd path (the torch backward): the gradients of a finite sequence's inputs are the same
    when another sequence of the batch holds a NaN."""
    def grads(inp):
        leaves = [x.detach().clone().double().requires_grad_() for x in inp.args()]
        h0 = inp.h0.detach().double()
        o, ht = CHUNK_OPS[fam](*leaves, initial_state=h0, output_final_state=True, backend="torch")
        (o[0].sum() + ht[0].sum()).backward()
        return [x.grad[0] for x in leaves]

    inp = make_inputs(fam, B=2, T=100, H=1, K=16, V=16, dtype=torch.float64)
    which = "g" if FAMILIES[fam].gate != "none" else "k"
    for clean, got in zip(grads(inp), grads(poisoned(inp, which, 50, "nan", row=1))):
        assert rel_err(got, clean) < 1e-14      # (summed in another order: the output's share and the state's)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("which", ["q", "k", "v", "g", "beta", "h0"])
@pytest.mark.parametrize("fam", FAMS)
def test_nan_propagates(fam, which, form):
    """The torch backend: a NaN reaches the later outputs and the final state (q: its own output only)."""
    inp = make_inputs(fam, B=2, T=100, dtype=torch.float32)
    x = getattr(inp, which)
    if x is None:                                                  # this family has no such input
        assert (which == "g" and FAMILIES[fam].gate == "none") or (which == "beta" and not FAMILIES[fam].delta)
        return
    t = 70
    if which == "h0":
        x[1, 0, 0, 0] = float("nan")
    else:
        x[1, t] = float("nan")
    op = (CHUNK_OPS if form == "chunk" else RECURRENT_OPS)[fam]
    o, ht = run(op, inp, "torch")
    assert torch.isfinite(o[0]).all() and torch.isfinite(ht[0]).all(), "the other sequence must stay finite"
    if which == "q":
        assert o[1, t].isnan().any() and torch.isfinite(o[1, :t]).all() and torch.isfinite(o[1, t + 1:]).all()
        assert torch.isfinite(ht[1]).all()
    else:
        first = 0 if which == "h0" else t
        assert torch.isfinite(o[1, :first]).all(), "NaN must not reach an earlier output"
        assert all(o[1, s].isnan().any() for s in range(first, 100)), "NaN must reach every later output"
        assert ht[1].isnan().any()
