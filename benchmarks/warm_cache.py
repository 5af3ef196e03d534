"""Build Triton's kernel cache for the H200 on a machine without a GPU, so that a device call spends its
minutes testing and timing rather than compiling (the GPU test runs of 2026-11-30 were compile-bound).

Triton is shown a stand-in driver whose target is sm_90 and every kernel launch becomes a warm-up: the
kernel is compiled (with the ptxas that ships with triton) and written to TRITON_CACHE_DIR, nothing
runs. Then the chosen GPU tests run on CPU tensors at their GPU sizes (tests/helpers.py reads
CHUNKWISE_WARM_SM90=1 as "GPU sizes, CPU tensors"): every launch they make is compiled with the same
arguments, hence the same specialisation and cache key as on the device. Their assertions fail (the
outputs are never computed): only the cache is kept. Intermediate IR files are dropped (the cubin and
the metadata are what a cache hit loads) and the cache is packed for the device tool's `carry`.

    python benchmarks/warm_cache.py                       # the `verify` selection -> .triton_sm90/cache.tgz
    python benchmarks/warm_cache.py -k "real_size" tests/test_triton_chunk_bwd.py
    python benchmarks/warm_cache.py --bench               # also the benchmarks' and sweeps' --warm launches

``--bench`` runs the warm-up mode of bench_forward (with --variants), sweep_stage1 and sweep_bwd on CPU
tensors (CHUNKWISE_BENCH_DEVICE=cpu), without fla (fla's kernels autotune on the device).

On the device, `benchmarks/gpu_session.sh` unpacks it to the same absolute path (Triton's cache index
stores absolute paths) and points TRITON_CACHE_DIR there. A kernel whose key differs (other code,
triton build or arguments) is compiled there as usual. The cache is only valid for the commit it was
built from: rebuild after any kernel change.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tarfile
import time

CACHE = "/tmp/triton_cache_sm90"     # the same absolute path on the device (gpu_session.sh)
VERIFY = ["tests/test_triton_chunk_fwd.py", "tests/test_triton_chunk_bwd.py",
          "-k", "real_size or hopper or unaligned or offsets_past"]


def _our_kernels() -> set:
    """The names of chunkwise's Triton kernels (the cache's other entries are fla's)."""
    import re
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "chunkwise", "triton")
    return {m for f in os.listdir(src) if f.endswith(".py")
            for m in re.findall(r"^def (\w+_kernel)\(", open(os.path.join(src, f)).read(), re.M)}


OURS = _our_kernels()


def install_sm90():
    """Make Triton compile for an H200 and launch nothing."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("warm_cache: nothing runs here")

    driver.set_active(Sm90())
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only


# benchmarks/repeat_bwd.py's settings for GDN's repeatability bisect (session 24's finding)
REPEAT_ENVS = ("default|CHUNKWISE_BWD_WY_DA_SCR=0|CHUNKWISE_FWD_OVERLAP=0|CHUNKWISE_BWD_OVERLAP=0|"
               "CHUNKWISE_FWD_OVERLAP=0,CHUNKWISE_BWD_OVERLAP=0|CHUNKWISE_BWD_DH_AHEAD=2")


def warm_benchmarks(only: str = ""):
    """The --warm passes of the benchmark scripts, on CPU tensors, fla hidden (``only``: those whose
    script name and arguments contain it, or, for a part that starts with "=", equal the rest)."""
    import importlib
    os.environ["CHUNKWISE_BENCH_DEVICE"] = "cpu"
    sys.modules["fla"] = None                      # import fla -> ImportError: the scripts skip it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    for script, argv in (("bench_forward", ["--warm"]), ("bench_forward", ["--warm", "--variants"]), ("sweep_stage1", ["--warm"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "pfree"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "pfree", "--families", "gdn",
                                            "--shapes", "B1-T32768-H32"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "tma"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "trans"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "kdasplit", "--families", "kda"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "tform", "--families", "gdn,delta,kda"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "bv128", "--families", "gdn,delta,kda"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "solvebf16", "--families", "gdn,delta,kda"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "tftrans", "--families", "delta,kda"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "aplowp", "--families", "kda"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "stages", "--families", "gdn,delta"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "solve", "--families", "gdn,kda,delta"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "pstages", "--families", "kda"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "overlap", "--families", "gdn,delta,kda",
                                            "--shapes", "B1-T32768-H32"]),
                         ("bench_forward", ["--warm", "--variants", "--variant-set", "prepwarps", "--families", "gdn,delta",
                                            "--shapes", "B1-T32768-H32"]),
                         ("sweep_bwd", ["--warm", "--warps", "4,8"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda", "--variants", "pair"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda", "--variants", "oneref"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda", "--variants", "gates"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,delta,gdn", "--variants", "regs"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,delta,gdn", "--variants", "save"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,delta,gdn", "--variants", "lowp"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,delta,gdn", "--variants", "ahead"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,delta,gdn", "--variants", "states"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,delta,gdn", "--variants", "tform"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda", "--variants", "pairregs"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,delta,gdn", "--variants", "dqk"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda", "--variants", "kdasplit"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda,gdn,delta", "--variants", "beside"]),
                         ("repeat_bwd", ["--warm", "--fams", "gdn", "--envs", REPEAT_ENVS]),
                         ("repeat_bwd", ["--warm", "--fams", "kda,delta,gla"]),
                         ("sweep_bwd", ["--warm", "--fams", "gdn,kda", "--variants", "sds"]),
                         ("sweep_bwd", ["--warm", "--fams", "kda", "--variants", "gc"]),
                         ("sweep_bwd", ["--warm", "--fams", "delta,gdn,gla", "--variants", "sides"]),
                         ("sweep_bwd", ["--warm", "--fams", "delta,gdn", "--variants", "leads"])):
        cmd = " ".join([script] + argv)
        if not any(cmd == o[1:] if o.startswith("=") else o in cmd for o in only.split("|")):
            continue
        t = time.time()
        sys.argv = [script] + argv
        try:
            importlib.import_module(script).main()
            status = "ok"
        except Exception as e:  # noqa: BLE001  (a failure after its launches still leaves them compiled)
            status = f"stopped: {e!r}"[:200]
        print(f"warm_cache: {script} {' '.join(argv)}: {status} ({time.time() - t:.0f} s)", file=sys.stderr)


def cubin_whole(path: str) -> bool:
    """Whether an ELF cubin holds its whole section table (a tar cut short leaves a truncated one, which the
    device rejects with "device kernel image is invalid")."""
    import struct
    st = os.stat(path)
    with open(path, "rb") as f:
        head = f.read(64)
        f.seek(0, os.SEEK_END)
        size = f.tell()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))     # a later --used-since run must not see it as used
    if len(head) < 64 or head[:4] != b"\x7fELF":
        return False
    (shoff,), (shentsize, shnum) = struct.unpack_from("<Q", head, 0x28), struct.unpack_from("<HH", head, 0x3A)
    return shoff + shentsize * shnum <= size


def prune(cache: str) -> tuple[int, int]:
    """Keep what a cache hit reads (the group index, metadata json, cubin); drop every entry whose cubin is cut
    short. Returns (kernels, bytes)."""
    import shutil
    for d in os.listdir(cache):
        full = os.path.join(cache, d)
        if any(f.endswith(".cubin") and not cubin_whole(os.path.join(full, f)) for f in os.listdir(full)):
            print(f"warm_cache: dropped {d} (truncated cubin)", file=sys.stderr)
            shutil.rmtree(full)
    kernels = size = 0
    for root, _, files in os.walk(cache):
        for f in files:
            path = os.path.join(root, f)
            if f.startswith("__grp__") or f.endswith((".json", ".cubin")):
                kernels += f.endswith(".cubin")
                size += os.path.getsize(path)
            else:
                os.remove(path)
    return kernels, size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".triton_sm90/cache.tgz", help="the packed cache (git-ignored; carry it)")
    ap.add_argument("--bench", action="store_true", help="also the benchmarks' and sweeps' warm-up launches")
    ap.add_argument("--no-tests", action="store_true", help="no tests (with --bench: the benchmarks only)")
    ap.add_argument("--bench-only", default="", help="with --bench: only the warm-ups whose command contains this "
                                                        "(or one of several separated by |; '=cmd': exactly cmd, e.g. '=bench_forward --warm')")
    ap.add_argument("--merge", action="append", default=[],
                    help="a new_cache.tgz a device run returned (gpu_session.sh): its entries (fla's autotuning "
                         "results and kernels compiled there) join the cache before it is packed (with --no-tests: "
                         "only that)")
    ap.add_argument("--used-only", action="store_true",
                    help="pack only the entries this run compiled or read (a device call's subset, when the whole "
                         "cache passes the 64 MiB carry limit); the cache on disk keeps everything")
    ap.add_argument("--used-since", type=float, default=0.0,
                    help="with --used-only: keep the access times and pack what was read or compiled since this "
                         "epoch second (several runs in one pack, e.g. tests under different CHUNKWISE_* settings)")
    ap.add_argument("pytest_args", nargs="*", help=f"tests to warm (default: {' '.join(VERIFY)})")
    a, rest = ap.parse_known_args()
    a.pytest_args += rest
    os.environ["TRITON_CACHE_DIR"] = CACHE
    os.environ["CHUNKWISE_WARM_SM90"] = "1"
    os.environ.pop("TRITON_INTERPRET", None)
    install_sm90()
    t0 = time.time()
    if a.used_since:
        t0 = a.used_since
    elif a.used_only:   # every access time back to 2000: a read here moves it past t0 (relatime: atime <= mtime)
        for root, _, files in os.walk(CACHE):
            for f in files:
                os.utime(os.path.join(root, f), (946684800, os.path.getmtime(os.path.join(root, f))))
    # fla's autotuning results kept in the repo (benchmarks/fla_autotune/*.tgz, autotune JSONs only, from earlier device
    # runs' harvests): fla's entries always go into the pack, so the device skips those searches (most of a forward
    # benchmark's device time was fla autotuning at every new shape)
    kept = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fla_autotune", "*.tgz")))
    for path in kept + a.merge:        # entries under triton_cache_sm90/ (the same absolute path on the device)
        with tarfile.open(path) as tar:
            tar.extractall(os.path.dirname(CACHE), filter="data")
        print(f"warm_cache: merged {path}", file=sys.stderr)
    if not a.no_tests:
        import pytest
        pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=no", "-p", "no:randomly"]
                    + (a.pytest_args or VERIFY))
    if a.bench:
        warm_benchmarks(a.bench_only)
    used = set()
    if a.used_only:     # before prune(), which reads every cubin's header (and so moves its access time)
        for d in os.listdir(CACHE):
            full = os.path.join(CACHE, d)
            files = os.listdir(full)
            if not any(f.endswith(".json") and f[:-5] in OURS for f in files) or any(
                    os.path.getatime(os.path.join(full, f)) >= t0 or os.path.getmtime(os.path.join(full, f)) >= t0
                    for f in files):          # fla's entries (its kernels, autotuning results) always
                used.add(d)
    kernels, size = prune(CACHE)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with tarfile.open(a.out, "w:gz") as tar:
        if a.used_only:
            for d in sorted(used):
                if os.path.isdir(os.path.join(CACHE, d)):       # (prune() may have dropped it)
                    tar.add(os.path.join(CACHE, d), arcname=os.path.join(os.path.basename(CACHE), d))
        else:
            tar.add(CACHE, arcname=os.path.basename(CACHE))
    print(f"warm_cache: {kernels} kernels, {size / 1e6:.1f} MB in {CACHE}, packed to {a.out} "
          f"({os.path.getsize(a.out) / 1e6:.1f} MB) in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
