"""Test setup: without a GPU the Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_logreport(report):
    """With CHUNKWISE_FAILLOG=<file>, append each failure's report to it as it happens.

    On the GPU machine a run can be cut by a time limit before pytest prints its summary (and xdist
    holds the messages until then); this keeps every failure message that happened so far.
    """
    path = os.environ.get("CHUNKWISE_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} [{report.when}]\n{report.longreprtext[-3000:]}\n")
