"""Static SASS instructions of a kernel per Python source line (sm_90, compiled off the device): where a
kernel's instructions come from, to read next to ncu's executed-instruction counts (NOTES.md).

    python benchmarks/sass_lines.py kda-prep [--top 40]        # KDA's stage 1 (benchmarks/prep_sass.py's build)

Assembles with `ptxas -lineinfo` and reads `nvdisasm -g` (each instruction after a `//## File ..., line N`
comment belongs to that line; inlined helpers report their own line). Counts are static: an instruction
in a loop body counts once, whatever the trip count.
"""
from __future__ import annotations

import argparse
import collections
import linecache
import os
import re
import subprocess
import tempfile

from sass_util import BIN


def lines_of(compiled):
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as fh:
            fh.write(compiled.asm["ptx"])
        subprocess.run([os.path.join(BIN, "ptxas"), "-lineinfo", "--gpu-name=sm_90a", ptx, "-o", cubin],
                       capture_output=True, text=True, check=True)
        text = subprocess.run([os.path.join(BIN, "nvdisasm"), "-g", cubin], capture_output=True, text=True,
                              check=True).stdout
    count, ops = collections.Counter(), collections.defaultdict(collections.Counter)
    where = ("?", 0)
    for line in text.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            count[where] += 1
            ops[where][m.group(1).split(".")[0]] += 1
    return count, ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=("kda-prep", "gdn-prep"))
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--bkc", type=int, default=32)
    a = ap.parse_args()
    from prep_sass import compile_variant
    compiled = compile_variant(a.kernel.split("-")[0], 0, 4, BKC=a.bkc)
    count, ops = lines_of(compiled)
    total = sum(count.values())
    print(f"{total} static instructions")
    for (f, n), c in count.most_common(a.top):
        src = linecache.getline(f, n).strip()[:90] if os.path.exists(f) else ""
        top = ", ".join(f"{o} {k}" for o, k in ops[(f, n)].most_common(4))
        print(f"{c:5d} {os.path.basename(f)}:{n:<5d} {src:90s} | {top}")


if __name__ == "__main__":
    main()
