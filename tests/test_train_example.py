"""examples/train_mqar.py: a 2-layer Gated DeltaNet LM trained with AdamW on multi-query associative
recall. A short run must really learn (the loss falls far below its start), and the torch and
triton backends must give the same losses on the first steps (triton: the interpreter on CPU)."""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import replace

import pytest
import torch

from helpers import INTERPRET, ON_GPU

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_mqar  # noqa: E402


def test_mqar_batch_layout():
    cfg = replace(train_mqar.CONFIGS["tiny"], batch=3)
    tokens, targets = train_mqar.mqar_batch(cfg, torch.Generator().manual_seed(0))
    L = 2 * (cfg.n_kv + cfg.n_q)
    assert tokens.shape == targets.shape == (3, L)
    half = cfg.vocab // 2
    for b in range(3):
        pairs = dict(zip(tokens[b, :2 * cfg.n_kv:2].tolist(), tokens[b, 1:2 * cfg.n_kv:2].tolist()))
        assert len(pairs) == cfg.n_kv and all(0 < key < half <= val < cfg.vocab for key, val in pairs.items())
        asked = tokens[b, 2 * cfg.n_kv::2].tolist()
        assert len(set(asked)) == cfg.n_q
        for j, key in enumerate(asked):   # at each query key the target is its value; elsewhere no loss
            pos = 2 * cfg.n_kv + 2 * j
            assert targets[b, pos] == pairs[key] == tokens[b, pos + 1]
        assert (targets[b] != -100).sum() == cfg.n_q


def test_short_training_run_learns():
    cfg = train_mqar.CONFIGS["short"]
    history = train_mqar.train(cfg, backend="torch", quiet=True)
    first = sum(h["loss"] for h in history[:5]) / 5
    last = train_mqar.final_loss(history)
    assert abs(first - math.log(cfg.vocab)) < 0.3              # starts at chance over the vocabulary
    assert last < cfg.threshold and last < 0.4 * first, (first, last)
    assert sum(h["acc"] for h in history[-20:]) / 20 > 0.5    # recall far above chance (1 / 8)


@pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
def test_torch_and_triton_backends_agree_on_first_steps(monkeypatch):
    from chunkwise import _custom_ops
    used = []
    real = _custom_ops.forward

    def spy(mode, *args):
        used.append((mode, args[-1]))
        return real(mode, *args)
    monkeypatch.setattr(_custom_ops, "forward", spy)
    cfg = train_mqar.CONFIGS["tiny"]
    device = "cuda" if ON_GPU else "cpu"
    torch_losses = [h["loss"] for h in train_mqar.train(cfg, backend="torch", device=device, quiet=True)]
    assert set(used) == {("chunk", "torch")}
    used.clear()
    triton_losses = [h["loss"] for h in train_mqar.train(cfg, backend="triton", device=device, quiet=True)]
    assert set(used) == {("chunk", "triton")}
    print("losses torch", torch_losses, "triton", triton_losses)
    assert len(torch_losses) == 2
    assert torch_losses[0] != torch_losses[1]                 # the first step changed the weights
    for a, b in zip(torch_losses, triton_losses):
        assert abs(a - b) <= 1e-4 * abs(a), (torch_losses, triton_losses)


def test_main_writes_plot_and_checks_threshold(tmp_path, monkeypatch):
    out = tmp_path / "out"
    rc = train_mqar.main(["--config", "tiny", "--backend", "torch", "--device", "cpu", "--out", str(out)])
    png = out / "loss.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "history.json").read_text())["config"]["steps"] == 2
    assert rc == 1    # two steps cannot reach the threshold: the script says so with its exit code


def test_main_writes_nothing_into_the_working_directory(tmp_path, monkeypatch):
    """By default the outputs go to the system's temporary folder, not where the script is run (a checkout)."""
    work, tmp = tmp_path / "checkout", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    train_mqar.main(["--config", "tiny", "--backend", "torch", "--device", "cpu"])
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in (tmp / "chunkwise-mqar").iterdir()) == ["history.json", "loss.png"]
