"""The `chunkwise` command: `check` passes on the real ops and fails on a wrong one; `bench` writes
its JSON and PNG; the console script and `python -m chunkwise` answer --help."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import chunkwise
from chunkwise import cli

FAMS = list(cli.FAMILIES)
# what `check` runs on here: bf16 Triton kernels on a GPU, the fp32 torch backend on the CPU
TOL = cli.TOLERANCE[cli._dtype("auto", cli._device("auto"))]


def test_check_quick_passes(capsys):
    assert cli.main(["check", "--quick", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert f"all {4 * len(FAMS)} ops match the float64 recurrence and gradients" in out
    for fam in FAMS:
        for form in ("chunk", "recurrent", "decode", "varlen"):
            line = next(ln for ln in out.splitlines() if ln.startswith(f"{fam} {form} "))
            assert line.rstrip().endswith("ok"), line
            err, grad_err = line.split()[-4:-2]     # the "max rel err" and "grad rel err" columns
            assert 0 < float(err) < TOL
            if form in ("chunk", "varlen"):          # the chunk ops train: their gradients are checked
                assert 0 < float(grad_err) < TOL
            else:
                assert grad_err == "-"


def _perturbed(op, rel):
    """The op with its output off by about ``rel`` relative error."""
    def wrong(*args, **kwargs):
        o, ht = op(*args, **kwargs)
        gen = torch.Generator().manual_seed(0)
        noise = torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)
        return o + rel * o.norm() / noise.norm() * noise, ht
    return wrong


@pytest.mark.parametrize("factor", [100, 3])
def test_check_planted_mismatch_fails(monkeypatch, capsys, factor):
    """An error of 3x the tolerance in the chunk op fails the chunk and varlen rows, only those."""
    monkeypatch.setattr(chunkwise, "chunk_gated_delta_rule",
                        _perturbed(chunkwise.chunk_gated_delta_rule, factor * TOL))
    assert cli.main(["check", "--quick", "--ops", "gdn"]) == 1
    captured = capsys.readouterr()
    rows = {" ".join(ln.split()[:2]): ln for ln in captured.out.splitlines() if ln.startswith("gdn ")}
    assert rows["gdn chunk"].rstrip().endswith("MISMATCH") and rows["gdn varlen"].rstrip().endswith("MISMATCH")
    assert rows["gdn recurrent"].rstrip().endswith("ok") and rows["gdn decode"].rstrip().endswith("ok")
    assert "2 of 4 ops FAILED" in captured.err


def test_check_planted_gradient_mismatch_fails(monkeypatch, capsys):
    """The chunk op right in the forward but with dq off by 3x the tolerance: its chunk and varlen rows fail on the
    gradient check alone, and --no-grads passes them."""
    op = chunkwise.chunk_kda

    def wrong_dq(q, *args, **kwargs):
        if q.requires_grad:
            q = q.view_as(q)
            q.register_hook(lambda dq: dq * (1 + 3 * TOL))
        return op(q, *args, **kwargs)
    monkeypatch.setattr(chunkwise, "chunk_kda", wrong_dq)
    assert cli.main(["check", "--quick", "--ops", "kda"]) == 1
    captured = capsys.readouterr()
    rows = {" ".join(ln.split()[:2]): ln.split() for ln in captured.out.splitlines() if ln.startswith("kda ")}
    for form in ("chunk", "varlen"):
        assert rows[f"kda {form}"][-1] == "MISMATCH" and float(rows[f"kda {form}"][-4]) < TOL
    assert rows["kda recurrent"][-1] == "ok"
    assert "2 of 4 ops FAILED" in captured.err and "gradient relative error" in captured.err
    assert cli.main(["check", "--quick", "--ops", "kda", "--no-grads"]) == 0


def test_check_op_that_raises_fails(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("planted failure")
    monkeypatch.setattr(chunkwise, "fused_recurrent_simple_gla", broken)
    assert cli.main(["check", "--quick", "--ops", "gla"]) == 1
    captured = capsys.readouterr()
    assert "ERROR" in captured.out and "planted failure" in captured.err


def _bench(tmp_path, *extra):
    out = tmp_path / "bench"
    rc = cli.main(["bench", "--device", "cpu", "--seqlens", "32,80", "--heads", "2", "--head-dim", "16",
                   "--reps", "1", "--out", str(out), *extra])
    return rc, out


def test_bench_writes_json_and_png(tmp_path):
    rc, out = _bench(tmp_path, "--ops", "gdn,kda,delta,gla")
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    for key in ("mode", "device", "dtype", "versions", "git_commit", "timing", "shapes", "results", "fla"):
        assert key in report
    assert report["mode"] == "fwd"
    assert report["versions"]["torch"] == torch.__version__
    assert report["shapes"] == {"B": 1, "H": 2, "HV": 2, "K": 16, "V": 16, "seqlens": [32, 80],
                                "ops": ["gdn", "kda", "delta", "gla"]}
    got = {(r["op"], r["T"]) for r in report["results"]}
    assert got == {(op, T) for op in FAMS for T in (32, 80)}
    for r in report["results"]:
        assert r["chunkwise_ms"] > 0 and r["chunkwise_tokens_per_s"] > 0
        assert r["chunkwise_tokens_per_s"] == pytest.approx(r["T"] / r["chunkwise_ms"] * 1e3)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("ops", [["gdn"], ["gdn", "kda", "delta", "gla"]], ids=["one-panel", "four-panels"])
def test_bench_plot_titles_inside_the_figure(ops):
    """The run's title (shape, dtype, a long device name) and each panel's title are drawn inside the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    device = "CPU AMD EPYC 7B13 64-Core Processor, 2 cores, 2 torch threads"
    results = [{"op": op, "T": T, "chunkwise_tokens_per_s": 1e5 * T} for op in ops for T in (256, 512)]
    report = {"mode": "fwd+bwd", "dtype": "bfloat16", "device": device, "results": results,
              "shapes": {"B": 1, "H": 16, "HV": 16, "K": 128, "V": 128, "seqlens": [256, 512], "ops": ops}}
    fig = cli._figure(report, plt)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        texts = [fig._suptitle] + [ax.title for ax in fig.axes]
        for text in texts:
            ext = text.get_window_extent(renderer)
            assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1, text.get_text()
        assert "EPYC" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_bench_backward(tmp_path):
    rc, out = _bench(tmp_path, "--ops", "kda", "--backward")
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == "fwd+bwd"
    assert all(r["chunkwise_ms"] > 0 for r in report["results"])


def test_bench_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib now raises ImportError
    rc, out = _bench(tmp_path, "--ops", "gla")
    assert rc == 0
    assert (out / "bench.json").exists() and not (out / "bench.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_unknown_op_is_refused():
    with pytest.raises(SystemExit, match="unknown op 'mamba'"):
        cli.main(["check", "--ops", "mamba"])


def _console_script():
    found = shutil.which("chunkwise") or os.path.join(os.path.dirname(sys.executable), "chunkwise")
    assert os.path.exists(found), "the chunkwise console script is not installed (pip install -e .)"
    return found


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["bench", "--help"]])
def test_help(argv):
    for cmd in ([sys.executable, "-m", "chunkwise"], [_console_script()]):
        res = subprocess.run(cmd + argv, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "usage: chunkwise" in res.stdout
        if argv == ["--help"]:
            assert "check" in res.stdout and "bench" in res.stdout
        else:
            assert "--device" in res.stdout and "--ops" in res.stdout


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "usage: chunkwise" in capsys.readouterr().out
