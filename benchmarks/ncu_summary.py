"""The lines of an Nsight Compute text report (benchmarks/gpu_session.sh's `ncu` part) that NOTES.md uses:
per kernel launch its duration, throughputs, registers, shared memory, occupancy, issue rate and the
stall reasons above 0.2 cycles per issued instruction, largest first.

    python3 benchmarks/ncu_summary.py ncu_kda_fwd.log
"""
from __future__ import annotations

import re
import sys

KEYS = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "Registers Per Thread",
        "Dynamic Shared Memory Per Block", "Theoretical Occupancy", "Achieved Occupancy",
        "Block Limit Registers", "Block Limit Shared Mem", "Warp Cycles Per Issued Instruction",
        "Issue Slots Busy", "Executed Ipc Active", "L1/TEX Hit Rate", "L2 Hit Rate", "Grid Size", "Block Size",
        "Executed Instructions", "Local Memory Spilling Requests")


def main(path):
    stalls = []

    def flush():
        if stalls:
            stalls.sort(key=lambda kv: -kv[1])
            print("    stalls (cycles / issue): " + ", ".join(f"{n} {v:.2f}" for n, v in stalls if v >= 0.2))
            stalls.clear()

    for line in open(path, errors="replace"):
        s = line.rstrip()
        if re.match(r"^\s{2}\S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", s):
            flush()
            print(s.strip()[:160])
            continue
        m = re.match(r"^\s+smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio\s+\S+\s+([\d.,]+)", s)
        if m:
            stalls.append((m.group(1), float(m.group(2).replace(",", ""))))
            continue
        t = s.strip()
        for key in KEYS:
            if t.startswith(key + " "):
                print("    " + re.sub(r"\s{2,}", "  ", t))
                break
    flush()


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"== {p}")
        main(p)
