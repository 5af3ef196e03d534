"""Test setup: without a GPU the Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here.
"""
import os
import sys

import pytest
import torch


def _offline_gpu_driver() -> bool:
    """Whether Triton's active driver already targets a GPU without one here (benchmarks/tools.py warm: kernels
    built for sm_90 from CPU tensors, nothing run)."""
    triton = sys.modules.get("triton")
    try:
        return triton is not None and triton.runtime.driver.active.get_current_target().backend == "cuda"
    except Exception:       # no driver at all
        return False


if not torch.cuda.is_available() and not _offline_gpu_driver():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default addopts): a worker per core, whose tests each run on one (under the interpreter) or
    mostly wait for the compiler (on a GPU); on a GPU at most one per 5 GB of its memory, which they share (an H100's
    80 GB: 15)."""
    cores = os.cpu_count() or 1
    if not torch.cuda.is_available():
        return cores
    return max(1, min(cores, torch.cuda.get_device_properties(0).total_memory // (5 << 30)))


# xdist workers share the cores: each takes its share of them for torch's CPU ops (the default, every core per
# worker, oversubscribes them many times over)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# a CUDA error that leaves the context unusable: every later test in the process would fail with it
_FATAL_CUDA = ("illegal memory access", "CUDA error: an illegal instruction", "unspecified launch failure",
               "misaligned address")
_poisoned = []


def pytest_addoption(parser):
    parser.addoption("--faillog", metavar="FILE", default=None,
                     help="append each failure's report to FILE as it happens (a GPU run cut by its time limit)")


_faillog = None      # --faillog's file


def pytest_configure(config):
    global _faillog
    _faillog = config.getoption("--faillog")


def pytest_runtest_logreport(report):
    """With --faillog FILE, append each failure's report to it as it happens.

    On the GPU machine a run can be cut by a time limit before pytest prints its summary (and xdist
    holds the messages until then); this keeps every failure message that happened so far.

    Under xdist, a test that broke the CUDA context (an illegal memory access, say) ends its worker
    after the test's teardown, so that xdist starts a fresh one (pass --max-worker-restart) instead of
    failing every later test of that worker with the same error.
    """
    if _faillog and report.failed:
        with open(_faillog, "a") as f:
            f.write(f"=== {report.nodeid} [{report.when}]\n{report.longreprtext[-3000:]}\n")
    if report.failed and any(m in report.longreprtext for m in _FATAL_CUDA):
        _poisoned.append(report.nodeid)
    if report.when == "teardown" and _poisoned and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)


@pytest.fixture
def no_floor(monkeypatch):
    """The sequence split at any length (configs.SPLIT_MIN_SEQ, a matter of host time, set to 0), for the tests that
    check the automatic split's results on sequences shorter than the floor."""
    import chunkwise.triton.configs as configs
    monkeypatch.setattr(configs, "SPLIT_MIN_SEQ", 0)
