"""Shared by the offline inspection scripts (decode_sass.py, prep_sass.py, bwd_sass.py): assemble a kernel
compiled for sm_90 with the ptxas that ships with triton and read back registers, spills and SASS."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(kernel, sig: dict, consts: dict, absent=(), **options):
    """``kernel`` compiled for an H200 (sm_90) without a GPU: the arguments in ``absent`` are dropped from ``sig``
    and passed as None, every other entry of ``consts`` is a constexpr, every pointer 16-byte aligned (as a
    launch with torch tensors specializes it). ``options``: num_warps, num_stages, maxnreg, ..."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, consts = dict(sig), dict(consts)
    for name in absent:
        sig.pop(name, None)
        consts[name] = None
    sig.update({name: "constexpr" for name in consts})
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if sig[a].startswith("*")}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def assemble(compiled, sass: bool = True) -> tuple[int, int, str]:
    """(registers per thread, spill-store bytes per thread, the SASS text or "") of a kernel that
    `triton.compile(..., target=GPUTarget("cuda", 90, 32))` returned."""
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as fh:
            fh.write(compiled.asm["ptx"])
        info = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        text = subprocess.run([os.path.join(BIN, "nvdisasm"), cubin], capture_output=True, text=True,
                              check=True).stdout if sass else ""
    spill = re.search(r"(\d+) bytes spill stores", info)
    return int(re.search(r"Used (\d+) registers", info).group(1)), int(spill.group(1)) if spill else 0, text
