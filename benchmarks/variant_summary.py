"""One line per (shape, family) of a bench_forward --variants JSON: our time, stage 1, fla, each variant's time, and the
largest relative difference of a variant's output against the default's (the sets that record it).

Usage: python benchmarks/variant_summary.py OUT/bench_forward.json
"""
import json
import sys

for r in json.load(open(sys.argv[1]))["results"]:
    var = r.get("variants", {})
    times = " ".join(f"{k}={x:.3f}" if isinstance(x, float) else f"{k}={x}"
                     for k, x in var.items() if not k.endswith("vs-default"))
    diff = max([x for k, x in var.items() if k.endswith("vs-default") and isinstance(x, float)] or [0])
    print(f"{r['shape']:20s} {r['family']:5s} {r['ours_ms']:.3f} s1={r.get('stage1_ms', float('nan')):.3f} "
          f"fla={r.get('fla_ms', float('nan')):.3f} | {times} | maxdiff {diff:.1e}")
