"""Test setup: without a GPU the Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
