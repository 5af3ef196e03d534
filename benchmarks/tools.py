"""Offline tools for the Triton kernels: sm_90 builds without a GPU, and profiling helpers.

    python benchmarks/tools.py ptx --out DIR [--src PATH] [--cases REGEX] [--jobs N] [--list]
    python benchmarks/tools.py ptx-diff A B [--cases REGEX] [--context 8] [--max 3]
    python benchmarks/tools.py warm [--cases REGEX] [--out .triton_sm90/cache.tgz] [-- PYTEST ARGS]
    python benchmarks/tools.py sass PATH [--kernel REGEX] [--lines N]
    python benchmarks/tools.py mem [--ops gdn,kda] [--shapes B1-T32768-H2-HV8]
    python benchmarks/tools.py ncu [--kernels REGEX] [--log FILE] -- COMMAND ...   |   ncu --summary FILE
    python benchmarks/tools.py timeline [--ops gdn] [--shapes B1-T32768-H32] [--calls 3]

``ptx`` drives the public API (every family, chunk and recurrent forms, forward and backward) over a list of
named cases on CPU tensors while Triton sees a stand-in driver for an H100 / H200 (sm_90, 132 SMs): every launch
compiles and nothing runs. It records each launch (kernel, specialization, num_warps / num_stages / maxnreg,
shared memory) and its PTX with names and line info taken out, into DIR/manifest.json and DIR/ptx/<sha256>.ptx.
``--src`` puts another tree's src/ first on sys.path, so that two trees can be compared:

    python benchmarks/tools.py ptx --src /path/to/old/src --out /tmp/ptx_old
    python benchmarks/tools.py ptx --out /tmp/ptx_new
    python benchmarks/tools.py ptx-diff /tmp/ptx_old /tmp/ptx_new     # exit status 1 if a launch differs

``ptx-diff`` pairs each case's launches by position (by kernel name where launches were added or removed) and
prints per kernel how many builds are identical, then the differing ones with their metadata and a diff excerpt.

``warm`` fills Triton's cache for an sm_90 device run from this machine, with the real ptxas (the cases above
and / or pytest tests, which see the stand-in driver as a GPU: its sizes on CPU tensors), and packs it for the device
tool's ``carry``. On the device, unpack it to the same absolute path (/tmp/triton_cache_sm90: Triton's cache
index holds absolute paths) and point TRITON_CACHE_DIR there. A cache is only valid for the code it was built from,
and only where Python's version is the device's: Triton's cache key hashes its libtriton, a file of its own per
Python version (the H100 / H200 image runs Python 3.12). Warmed here, the GPU test files built 2036 kernels (sm_90,
triton 3.6.0; 347 MB of cubins, 45 MB as tar.xz); on an H100 from a cold cache they built 2085 in 342 s.

``mem`` gives the peak memory of a training step (forward, then backward, bf16) above its inputs, from the
allocations the launchers make on CPU tensors under the stand-in driver (torch.profiler's memory events); it agreed
with the GPU's torch.cuda.max_memory_allocated within 2 MiB on every family.

``sass`` summarizes cubins (a Triton cache dir) or PTX files (a ``ptx`` output dir; assembled here with the ptxas
that ships with triton): registers, spill bytes, shared memory, instruction counts; ``--lines N`` the N source
lines with the most static instructions of each kernel. ``ncu`` runs a command under Nsight Compute and prints,
per launch, duration, throughputs, occupancy, issue rate and the stall reasons above 0.2 cycles per issue.
``timeline`` (GPU) prints when each kernel of a forward call (``--train``: a training step) starts and ends on which
stream, called eagerly and replayed from a CUDA graph, each call after an L2 flush as the benchmarks time it
(torch.profiler's kernel events).
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time

WARM_CACHE = "/tmp/triton_cache_sm90"      # the same absolute path on the device
SM90_PROPS = dict(multiprocessor_count=132, max_shared_mem=232448, max_num_regs=65536, warpSize=32,
                  sm_clock_rate=1980000, mem_clock_rate=2619000, mem_bus_width=5120)


def triton_bin(tool: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


# ----------------------------------------------------------------------------------------------
# the stand-in sm_90 driver
# ----------------------------------------------------------------------------------------------

LAUNCHES: list = []     # (JITFunction, CompiledKernel) of every launch since the list was last cleared


class OfflineSm90Driver:
    """Triton's active driver while kernels are built for sm_90 (an H100 / H200, 132 SMs) without a GPU.
    The library plans as on that GPU from CPU tensors when it sees this driver (``offline`` is the mark)."""
    offline = True

    class utils:
        @staticmethod
        def get_device_properties(device=0):
            return dict(SM90_PROPS)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("the offline sm_90 driver runs nothing (an autotuner with several configs cannot pick)")


def install_sm90(ptx_only: bool = False):
    """Make Triton compile for sm_90 and launch nothing; every launch is appended to LAUNCHES.
    ``ptx_only``: stop at the PTX (no ptxas; the cubin is left empty)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["CHUNKWISE_WARM_SM90"] = "1"     # (the pre-change code's switch for "plan as on the GPU")
    driver.set_active(OfflineSm90Driver())
    if ptx_only:
        from triton.backends.nvidia.compiler import CUDABackend
        CUDABackend.make_cubin = lambda self, src, metadata, opt, capability: b""
    if getattr(JITFunction.run, "offline_sm90", False):
        return
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        LAUNCHES.append((self, kernel))
        return kernel

    compile_only.offline_sm90 = True
    JITFunction.run = compile_only


def plan_decode_as_gpu():
    """The pre-change decode launcher (triton/recurrent.py) plans from ``device.type``: CPU tensors get the
    interpreter's tiles and no pipelined loop. Where that test is in its source, wrap it to plan as on a CUDA
    device with 132 SMs (what it does on an H100 / H200); code that detects the stand-in driver is left alone."""
    import importlib
    import inspect
    import torch
    for name in ("chunkwise.triton.recurrent", "chunkwise.triton.decode"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        cfg, launcher = getattr(mod, "_launch_config", None), getattr(mod, "recurrent_fwd", None)
        if cfg is not None and 'device.type != "cuda"' in inspect.getsource(cfg):
            mod._sm_count = lambda index: SM90_PROPS["multiprocessor_count"]
            mod._launch_config = lambda device, *a, _cfg=cfg: _cfg(torch.device("cuda", 0), *a)
        if launcher is not None and 'pipeline = 2 if q.device.type == "cuda"' in inspect.getsource(launcher):
            def gpu_pipeline(*a, _launch=launcher, **kw):
                kw["pipeline"] = 2 if kw.get("pipeline") is None else kw["pipeline"]
                return _launch(*a, **kw)
            mod.recurrent_fwd = gpu_pipeline


# ----------------------------------------------------------------------------------------------
# PTX normalization
# ----------------------------------------------------------------------------------------------

def normalize_ptx(ptx: str) -> str:
    """PTX without what names and line info change: .loc / .file, the debug sections, debug labels, comments;
    the kernel ("KERNEL"), any callee ("FUNC<i>") and their parameters renamed in order of appearance."""
    out, depth, opened = [], None, False
    for line in ptx.splitlines():
        s = line.split("//", 1)[0].rstrip()
        if depth is None and re.match(r"\s*\.section\s+\.debug", s):
            depth, opened = 0, False
        if depth is not None:       # inside a debug section: up to its closing brace
            depth += s.count("{") - s.count("}")
            opened = opened or "{" in s
            if opened and depth <= 0:
                depth = None
            continue
        if not s.strip() or re.match(r"\s*\.(loc|file)\b", s) or re.match(r"\$L__(tmp|func_begin|func_end)\d+:", s):
            continue
        out.append(s)
    text = "\n".join(out) + "\n"
    ident = r"([A-Za-z_$][\w$.]*)"
    names = [(n, "KERNEL") for n in re.findall(r"\.entry\s+" + ident + r"\s*\(", text)]
    funcs = dict.fromkeys(re.findall(r"\.func\s+(?:\([^)]*\)\s*)?" + ident + r"\s*\(", text))
    names += [(n, f"FUNC{i}") for i, n in enumerate(funcs)]
    for name, new in names:
        params = dict.fromkeys(re.findall(re.escape(name) + r"_param_\d+", text))
        for j, p in enumerate(params):
            text = re.sub(re.escape(p) + r"(?![\w$])", f"{new}_param_{j}", text)
        text = re.sub(r"(?<![\w$.])" + re.escape(name) + r"(?![\w$])", new, text)
    return text


# ----------------------------------------------------------------------------------------------
# the cases
# ----------------------------------------------------------------------------------------------

FAMILIES = {    # name: (chunk op, recurrent op, gate: None / "scalar" / "channel", delta rule)
    "gdn": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "scalar", True),
    "kda": ("chunk_kda", "fused_recurrent_kda", "channel", True),
    "delta": ("chunk_delta_rule", "fused_recurrent_delta_rule", None, True),
    "gla": ("chunk_simple_gla", "fused_recurrent_simple_gla", "scalar", False),
}
DTYPES = ("bf16", "fp16", "fp32")
DIMS = ((128, 128), (64, 64), (256, 256), (100, 100))


def case(fam, form, dtype, B, T, H, HV=None, K=128, V=None, *, train=False, lens=None, host=False, h0=None,
         ht=False, tr=False, pool=None, beta32=False) -> dict:
    """One call of the public API. lens: varlen sequence lengths (B = 1, T = their sum); host: with
    cu_seqlens_cpu and chunk_indices; h0: None or the initial state's dtype ("fp32", "bf16", "fp16"); ht: output_final_state (and its
    gradient used); tr: transpose_state_layout; pool: a state pool of that dtype (recurrent, state_indices);
    beta32: beta as logits through use_beta_sigmoid_in_kernel (fp32 beta with 16-bit q)."""
    HV, V = HV or H, V or K
    if lens:
        B, T = 1, sum(lens)
    lay = f"varlen{len(lens)}-T{T}" if lens else f"B{B}-T{T}"
    name = (f"{fam}-{form}-{'train' if train else 'infer'}-{dtype}-{lay}-H{H}" + (f"-HV{HV}" if HV != H else "")
            + f"-K{K}" + (f"-V{V}" if V != K else "") + ("-host" if host else "")
            + (f"-h0{'' if h0 == 'fp32' else h0}" if h0 else "") + ("-ht" if ht else "") + ("-tr" if tr else "")
            + (f"-pool{pool}" if pool else "") + ("-beta32" if beta32 else ""))
    return dict(name=name, fam=fam, form=form, dtype=dtype, B=B, T=T, H=H, HV=HV, K=K, V=V, train=train,
                lens=lens, host=host, h0=h0, ht=ht, tr=tr, pool=pool, beta32=beta32)


def all_cases() -> list:
    cases = []
    for fam in FAMILIES:
        for dt in DTYPES:
            for K, V in DIMS:
                for train in (True, False):
                    c = dict(K=K, V=V, train=train)
                    cases += [case(fam, "chunk", dt, 2, 128, 2, **c, h0="fp32", ht=True, tr=True),
                              case(fam, "chunk", dt, 2, 130, 2, 4, **c, ht=True),
                              case(fam, "chunk", dt, 1, 0, 2, 4, **c, lens=(1, 63, 66), h0="fp32"),
                              case(fam, "chunk", dt, 1, 0, 2, 4, **c, lens=(1, 63, 66), host=True, h0="fp32")]
                cases += [case(fam, "recurrent", dt, 3, 1, 2, 4, K=K, V=V, h0="fp32", ht=True),
                          case(fam, "recurrent", dt, 1, 0, 2, K=K, V=V, lens=(3, 4), h0="fp32", ht=True, tr=True),
                          case(fam, "recurrent", dt, 2, 3, 2, K=K, V=V, ht=True),
                          case(fam, "recurrent", dt, 3, 1, 2, K=K, V=V, h0="fp32", pool="fp32"),
                          case(fam, "recurrent", dt, 4, 2, 2, 4, K=K, V=V, h0="fp32", pool="fp32", tr=True)]
            for train in (True, False):
                # K != V (Mamba2's d_state 128 / headdim 64; context parallelism runs V + K value columns), T = 1
                cases += [case(fam, "chunk", dt, 2, 130, 2, 4, K=128, V=64, train=train, ht=True),
                          case(fam, "chunk", dt, 2, 130, 2, 4, K=128, V=256, train=train, ht=True),
                          case(fam, "chunk", dt, 1, 1, 2, K=64, train=train, h0="fp32", ht=True)]
            # the plans of the benchmark shapes (B1-T32768-H32, B8-T4096-H32, B4-T8192-H16/HV32, varlen16-T32768-H32):
            # a plan depends on the programs per SM (B·HV) and, for simple GLA's segments, on the chunks per
            # sequence; shorter T with the same plans keeps the CPU tensors small. K = V = 128.
            for train in (True, False):
                for B, T, H, HV, lens in ((1, 8192, 32, 32, None), (8, 1024, 32, 32, None), (4, 2048, 16, 32, None),
                                          (1, 4096, 2, 8, None), (1, 32768, 2, 8, None), (1, 0, 32, 32, (512,) * 16)):
                    cases.append(case(fam, "chunk", dt, B, T, H, HV, train=train, lens=lens))
            for B, H, HV in ((256, 32, 32), (16, 32, 32), (4, 16, 32), (1, 2, 8)):
                cases.append(case(fam, "recurrent", dt, B, 1, H, HV, h0="fp32", ht=True))
            if dt != "fp32":
                # other dtypes the arguments may take: states in the input dtype, bf16 pools, fp32 beta (logits
                # through use_beta_sigmoid_in_kernel)
                cases += [case(fam, "chunk", dt, 2, 128, 2, train=True, h0=dt, ht=True),
                          case(fam, "chunk", dt, 2, 128, 2, h0=dt, ht=True, tr=True),
                          case(fam, "recurrent", dt, 3, 1, 2, h0=dt, ht=True),
                          case(fam, "recurrent", dt, 3, 1, 2, h0="bf16", pool="bf16")]
                if FAMILIES[fam][3]:
                    cases += [case(fam, "chunk", dt, 2, 128, 2, train=True, beta32=True),
                              case(fam, "chunk", dt, 2, 128, 2, beta32=True),
                              case(fam, "recurrent", dt, 3, 1, 2, h0="fp32", ht=True, beta32=True)]
    return cases


def op_inputs(fam: str, B, T, H, HV, K, V, dtype, grad: bool, beta_dtype=None) -> list:
    """The chunk op's positional inputs, zeros (their values unused): q, k, v, then the gate (fp32) and β where the
    family takes them."""
    import torch
    _, _, gate, delta = FAMILIES[fam]
    x = lambda *shape, dtype=dtype: torch.zeros(*shape, dtype=dtype, requires_grad=grad)  # noqa: E731
    args = [x(B, T, H, K), x(B, T, H, K), x(B, T, HV, V)]
    if gate:
        args.append(x(B, T, HV, *((K,) if gate == "channel" else ()), dtype=torch.float32))
    if delta:
        args.append(x(B, T, HV, dtype=beta_dtype or dtype))
    return args


def run_case(c: dict):
    """One call of the public API (and its backward when training) on CPU tensors."""
    import torch
    import chunkwise
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[c["dtype"]]
    chunk_op, rec_op = FAMILIES[c["fam"]][:2]
    B, T, H, HV, K, V = (c[x] for x in ("B", "T", "H", "HV", "K", "V"))
    train = c["train"]
    x = lambda *shape, dtype=dt: torch.zeros(*shape, dtype=dtype, requires_grad=train)  # noqa: E731 (values unused)
    args = op_inputs(c["fam"], B, T, H, HV, K, V, dt, train, torch.float32 if c["beta32"] else dt)
    N = len(c["lens"]) if c["lens"] else B
    kw = dict(backend="triton", output_final_state=c["ht"], transpose_state_layout=c["tr"])
    if c["beta32"]:
        kw["use_beta_sigmoid_in_kernel"] = True
    if c["lens"]:
        cu = torch.tensor([0] + [sum(c["lens"][:i + 1]) for i in range(len(c["lens"]))], dtype=torch.int32)
        kw["cu_seqlens"] = cu
        if c["host"]:
            kw.update(cu_seqlens_cpu=cu.clone(), chunk_indices=chunkwise.prepare_chunk_indices(cu))
    state = (V, K) if c["tr"] else (K, V)
    sdt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c["pool"] or c["h0"], torch.float32)
    if c["pool"]:
        kw["initial_state"] = torch.zeros(N + 1, HV, *state, dtype=sdt)
        kw["state_indices"] = torch.tensor([-1 if i == 1 else N - i for i in range(N)], dtype=torch.int32)
    elif c["h0"]:
        kw["initial_state"] = x(N, HV, *state, dtype=sdt)
    op = getattr(chunkwise, chunk_op if c["form"] == "chunk" else rec_op)
    with torch.set_grad_enabled(train):
        o, ht = op(*args, **kw)
        if train:
            outs = [o] + ([ht] if ht is not None else [])
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def record(fn, kernel, memo: dict, ptx_dir: str) -> dict:
    """One launch's entry of the manifest (its normalized PTX written once under ptx_dir)."""
    if kernel.hash not in memo:
        text = normalize_ptx(kernel.asm["ptx"])
        sha = hashlib.sha256(text.encode()).hexdigest()
        path = os.path.join(ptx_dir, sha + ".ptx")
        if not os.path.exists(path):
            with open(path, "w") as fh:
                fh.write(text)
        src, md = kernel.src, kernel.metadata
        # constexprs by value, the other arguments by type (pointers: "*bf16"), ":16" where divisible by 16
        const = {fn.arg_names[p[0]]: v for p, v in src.constants.items() if len(p) == 1}
        div = {fn.arg_names[p[0]] for p, v in src.attrs.items() if len(p) == 1 and ["tt.divisibility", 16] in v}
        spec = {n: (const[n] if isinstance(const[n], (int, float, str, bool, type(None))) else str(const[n]))
                if n in const else ty + (":16" if n in div else "") for n, ty in src.signature.items()}
        meta = dict(num_warps=md.num_warps, num_stages=md.num_stages, maxnreg=md.maxnreg, num_ctas=md.num_ctas,
                    shared=md.shared)
        memo[kernel.hash] = dict(kernel=fn.__name__, meta=meta, spec=spec, sha=sha,
                                 build=os.path.basename(os.path.dirname(next(iter(kernel.metadata_group.values())))))
    return memo[kernel.hash]


def cmd_ptx(a):
    if a.src:
        sys.path.insert(0, os.path.abspath(a.src))
    for var in [v for v in os.environ if v.startswith("CHUNKWISE_")]:
        del os.environ[var]                 # the defaults only
    cases = [c for c in all_cases() if re.search(a.cases or "", c["name"])]
    if a.list:
        print("\n".join(c["name"] for c in cases))
        return 0
    os.makedirs(os.path.join(a.out, "ptx"), exist_ok=True)
    if a.jobs > 1:
        return ptx_jobs(a, cases)
    if a.part:          # one of ptx_jobs' workers: every a.jobs-th family
        i, n = map(int, a.part.split("/"))
        cases = [c for c in cases if list(FAMILIES).index(c["fam"]) % n == i]
    # a fresh Triton cache (kept: its raw PTX / TTGIR by the manifest's "build" hash)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="cache_", dir=a.out)
    install_sm90(ptx_only=True)
    import chunkwise
    import torch
    import triton
    plan_decode_as_gpu()
    torch.manual_seed(0)
    memo, manifest, t0 = {}, {}, time.time()

    def write(done):
        info = dict(src=os.path.dirname(chunkwise.__file__), triton=triton.__version__, torch=torch.__version__,
                    cases=len(cases), done=done, launches=sum(len(m["launches"]) for m in manifest.values()),
                    builds=len(memo), distinct_ptx=len({m["sha"] for m in memo.values()}),
                    kernels=len({m["kernel"] for m in memo.values()}), seconds=round(time.time() - t0))
        with open(os.path.join(a.out, f"manifest{'.' + a.part.replace('/', 'of') if a.part else ''}.json"), "w") as fh:
            json.dump(dict(info=info, cases=manifest), fh, indent=1)
        return info

    for i, c in enumerate(cases):
        LAUNCHES.clear()
        t = time.time()
        error = None
        try:
            run_case(c)
        except Exception as e:  # noqa: BLE001  (kept in the manifest: the same call must fail the same way)
            error = f"{type(e).__name__}: {e}"[:300]
        launches = [record(fn, kern, memo, os.path.join(a.out, "ptx")) for fn, kern in LAUNCHES]
        manifest[c["name"]] = dict(launches=launches, **({"error": error} if error else {}))
        print(f"[{i + 1}/{len(cases)}] {c['name']}: {len(launches)} launches, {time.time() - t:.1f} s"
              + (f"  ERROR {error}" if error else ""), flush=True)
        if i % 50 == 49:        # (a partial manifest while it runs)
            write(i + 1)
    print(json.dumps(write(len(cases))))
    return 0


def ptx_jobs(a, cases) -> int:
    """The cases in ``a.jobs`` processes, by family (each with its own Triton cache); one manifest."""
    t0, argv = time.time(), [sys.executable, os.path.abspath(__file__), "ptx", "--out", a.out]
    argv += (["--src", a.src] if a.src else []) + (["--cases", a.cases] if a.cases else [])
    procs = [subprocess.Popen(argv + ["--part", f"{i}/{a.jobs}"]) for i in range(a.jobs)]
    if any(p.wait() for p in procs):
        sys.exit("ptx: a worker failed")
    parts = [json.load(open(os.path.join(a.out, f"manifest.{i}of{a.jobs}.json"))) for i in range(a.jobs)]
    merged = {k: v for p in parts for k, v in p["cases"].items()}
    info = dict(parts[0]["info"], cases=len(cases), done=len(merged), seconds=round(time.time() - t0), jobs=a.jobs)
    for key in ("launches", "builds"):
        info[key] = sum(p["info"][key] for p in parts)
    builds = [x for c in merged.values() for x in c["launches"]]
    info.update(distinct_ptx=len({x["sha"] for x in builds}), kernels=len({x["kernel"] for x in builds}))
    with open(os.path.join(a.out, "manifest.json"), "w") as fh:
        json.dump(dict(info=info, cases={c["name"]: merged[c["name"]] for c in cases if c["name"] in merged}), fh,
                  indent=1)
    print(json.dumps(info))
    return 0


# ----------------------------------------------------------------------------------------------
# the comparison
# ----------------------------------------------------------------------------------------------

def pair_launches(la: list, lb: list) -> list:
    """[(i or None, j or None)]: by position where the counts agree, else aligned by kernel name (a replaced run
    of equal length paired by position)."""
    if len(la) == len(lb):
        return list(zip(range(len(la)), range(len(lb))))
    pairs = []
    sm = difflib.SequenceMatcher(a=[x["kernel"] for x in la], b=[x["kernel"] for x in lb], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            pairs += list(zip(range(i1, i2), range(j1, j2)))
        else:
            pairs += [(i, None) for i in range(i1, i2)] + [(None, j) for j in range(j1, j2)]
    return pairs


def cmd_diff(a):
    A, B = (json.load(open(os.path.join(d, "manifest.json"))) for d in (a.a, a.b))
    rows, details, one_sided, errors, seen = {}, [], [], [], set()
    for name in sorted(n for n in set(A["cases"]) | set(B["cases"]) if re.search(a.cases or "", n)):
        ca, cb = A["cases"].get(name), B["cases"].get(name)
        if ca is None or cb is None:
            one_sided.append(f"case {name}: only in {a.a if cb is None else a.b}")
            continue
        if ca.get("error") != cb.get("error"):
            errors.append(f"case {name}: {ca.get('error')!r} -> {cb.get('error')!r}")
        for i, j in pair_launches(ca["launches"], cb["launches"]):
            if i is None or j is None:
                x = ca["launches"][i] if j is None else cb["launches"][j]
                one_sided.append(f"{name} #{i if j is None else j}: {x['kernel']} only in {a.a if j is None else a.b}")
                continue
            x, y = ca["launches"][i], cb["launches"][j]
            key = x["kernel"] if x["kernel"] == y["kernel"] else f"{x['kernel']} -> {y['kernel']}"
            same = x["sha"] == y["sha"] and x["meta"] == y["meta"]
            row = rows.setdefault(key, dict(launches=0, same=set(), diff=set()))
            row["launches"] += 1
            row["same" if same else "diff"].add((x["sha"], y["sha"]))
            if not same and (x["sha"], y["sha"], str(x["meta"]), str(y["meta"])) not in seen:
                seen.add((x["sha"], y["sha"], str(x["meta"]), str(y["meta"])))
                details.append((key, name, i, x, y))
    w = max([len(k) for k in rows] + [6])
    print(f"{'kernel':{w}s}  launches  builds  identical  DIFFERENT")
    for key, r in sorted(rows.items()):
        n = len(r["same"] | r["diff"])
        print(f"{key:{w}s}  {r['launches']:8d}  {n:6d}  {len(r['same']):9d}  {len(r['diff']):9d}")
    shown = {}
    for key, name, i, x, y in details:
        shown[key] = shown.get(key, 0) + 1
        if shown[key] > a.max:
            continue
        print(f"\nDIFFERENT {name} #{i} {x['kernel']} -> {y['kernel']}")
        for k in sorted(set(x["meta"]) | set(y["meta"])):
            if x["meta"].get(k) != y["meta"].get(k):
                print(f"  meta {k}: {x['meta'].get(k)} -> {y['meta'].get(k)}")
        for k in sorted(set(x["spec"]) | set(y["spec"])):
            if x["spec"].get(k, "-") != y["spec"].get(k, "-"):
                print(f"  spec {k}: {x['spec'].get(k, '-')} -> {y['spec'].get(k, '-')}")
        if x["sha"] != y["sha"]:
            pa, pb = (open(os.path.join(d, "ptx", s + ".ptx")).read().splitlines()
                      for d, s in ((a.a, x["sha"]), (a.b, y["sha"])))
            diff = list(difflib.unified_diff(pa, pb, "a", "b", n=2, lineterm=""))
            print("\n".join("  " + ln for ln in diff[2:2 + a.context * 3]))
            print(f"  ({sum(ln[:1] in '+-' for ln in diff[2:])} lines differ; {a.a}/ptx/{x['sha']}.ptx)")
    for key, n in shown.items():
        if n > a.max:
            print(f"\n({key}: {n - a.max} more differing builds not shown; --max)")
    for line in one_sided + errors:
        print(line)
    n_diff = sum(len(r["diff"]) for r in rows.values())
    print(f"\n{sum(r['launches'] for r in rows.values())} launches paired, {n_diff} differing builds, "
          f"{len(one_sided)} one-sided, {len(errors)} changed errors")
    return 1 if n_diff or one_sided or errors else 0


# ----------------------------------------------------------------------------------------------
# warm cache, SASS, Nsight Compute
# ----------------------------------------------------------------------------------------------

def cmd_warm(a):
    for var in [v for v in os.environ if v.startswith("CHUNKWISE_")]:
        del os.environ[var]
    if not a.cases and not a.pytest_args:
        sys.exit("warm: give --cases REGEX and / or pytest arguments after --")
    os.environ["TRITON_CACHE_DIR"] = WARM_CACHE
    install_sm90()                  # ptxas runs: the cache holds cubins a device run loads
    plan_decode_as_gpu()
    t0 = time.time()
    for c in [c for c in all_cases() if a.cases and re.search(a.cases, c["name"])]:
        try:
            run_case(c)
        except Exception as e:  # noqa: BLE001  (what it launched before failing is compiled)
            print(f"warm: {c['name']}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
    if a.pytest_args:
        import pytest     # the tests see the stand-in driver as a GPU (its sizes on CPU tensors); their asserts fail
        pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=no"] + a.pytest_args)
    kernels = size = 0
    for root, _, files in os.walk(WARM_CACHE):     # what a cache hit reads: the group index, metadata, cubin
        for f in files:
            path = os.path.join(root, f)
            if f.startswith("__grp__") or f.endswith((".json", ".cubin")):
                kernels, size = kernels + f.endswith(".cubin"), size + os.path.getsize(path)
            else:
                os.remove(path)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with tarfile.open(a.out, "w:gz") as tar:
        tar.add(WARM_CACHE, arcname=os.path.basename(WARM_CACHE))
    print(f"warm: {kernels} kernels, {size / 1e6:.1f} MB in {WARM_CACHE}, packed to {a.out} "
          f"({os.path.getsize(a.out) / 1e6:.1f} MB) in {time.time() - t0:.0f} s")
    return 0


SASS_OPS = dict(mma=("HMMA", "HGMMA"), shfl=("SHFL",), bar=("BAR",), lds=("LDS", "LDSM"), sts=("STS",),
                ldg=("LDG", "LDGSTS", "UTMALDG"), local=("LDL", "STL"))


def sass_of(path: str, lines: bool) -> dict:
    """Registers, spill bytes and instruction counts of a cubin or a PTX file (assembled for sm_90a here)."""
    with tempfile.TemporaryDirectory() as d:
        cubin, info = path, ""
        if path.endswith(".ptx"):
            cubin = os.path.join(d, "k.cubin")
            info = subprocess.run([triton_bin("ptxas"), "-v", "-lineinfo", "--gpu-name=sm_90a", path, "-o", cubin],
                                  capture_output=True, text=True, check=True).stderr
        else:
            info = subprocess.run([triton_bin("cuobjdump"), "--dump-resource-usage", cubin],
                                  capture_output=True, text=True, check=True).stdout
        text = subprocess.run([triton_bin("nvdisasm")] + (["-g"] if lines else []) + [cubin],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"(?:Used (\d+) registers|REG:(\d+))", info)
    spill = re.search(r"(?:(\d+) bytes spill stores|LOCAL:(\d+))", info)
    out = dict(regs=int(next(g for g in regs.groups() if g)) if regs else -1,
               spill=int(next(g for g in spill.groups() if g)) if spill else 0)
    ops, where, by_line = [], None, {}
    for ln in text.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            where = (os.path.basename(m.group(1)), int(m.group(2)))
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
        if m:
            ops.append(m.group(1).split(".")[0])
            by_line[where] = by_line.get(where, 0) + 1
    out.update(instrs=len(ops), **{k: sum(o in names for o in ops) for k, names in SASS_OPS.items()})
    return dict(out, lines=sorted(((n, w) for w, n in by_line.items() if w), reverse=True))


def cmd_sass(a):
    """A Triton cache dir (its cubins, named by their metadata) or a ``ptx`` output dir (its manifest's builds)."""
    items = []          # (label, path, shared)
    if os.path.exists(os.path.join(a.path, "manifest.json")):
        seen = {}
        for name, c in json.load(open(os.path.join(a.path, "manifest.json")))["cases"].items():
            for x in c["launches"]:
                seen.setdefault(x["sha"], (f"{x['kernel']} ({name})", x["meta"]["shared"]))
        items = [(label, os.path.join(a.path, "ptx", sha + ".ptx"), sh) for sha, (label, sh) in seen.items()]
    else:
        for root, _, files in os.walk(a.path):
            for f in files:
                if f.endswith(".cubin") and os.path.getsize(os.path.join(root, f)):
                    md = json.load(open(os.path.join(root, f[:-6] + ".json")))
                    items.append((f"{md['name']} w{md['num_warps']} s{md['num_stages']} {os.path.basename(root)[:8]}",
                                  os.path.join(root, f), md.get("shared", 0)))
    items = [it for it in sorted(items) if re.search(a.kernel or "", it[0])]
    print(f"{'kernel':60s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'instrs':>6s} " +
          " ".join(f"{k:>5s}" for k in SASS_OPS))
    for label, path, shared in items:
        s = sass_of(path, bool(a.lines))
        print(f"{label[:60]:60s} {s['regs']:4d} {s['spill']:5d} {shared:6d} {s['instrs']:6d} " +
              " ".join(f"{s[k]:5d}" for k in SASS_OPS), flush=True)
        for n, (f, line) in s["lines"][:a.lines]:
            print(f"    {n:5d}  {f}:{line}")
    return 0


NCU_KEYS = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "Registers Per Thread",
            "Dynamic Shared Memory Per Block", "Theoretical Occupancy", "Achieved Occupancy", "Block Limit Registers",
            "Block Limit Shared Mem", "Warp Cycles Per Issued Instruction", "Issue Slots Busy", "Executed Ipc Active",
            "L1/TEX Hit Rate", "L2 Hit Rate", "Grid Size", "Block Size", "Executed Instructions",
            "Local Memory Spilling Requests")


def ncu_summary(path: str):
    """Per launch of an ncu text report: the NCU_KEYS lines and the stall reasons of >= 0.2 cycles per issue."""
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
        elif any(s.strip().startswith(k + " ") for k in NCU_KEYS):
            print("    " + re.sub(r"\s{2,}", "  ", s.strip()))
    flush()


def cmd_ncu(a):
    if not a.summary:
        if not a.command:
            sys.exit("ncu: give the command to profile after --")
        sections = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats",
                    "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "InstructionStats")
        cmd = (["ncu", "--clock-control", "none"] + [x for s in sections for x in ("--section", s)]
               + ["--metrics", r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"]
               + (["-k", "regex:" + a.kernels] if a.kernels else []) + (["-s", str(a.skip)] if a.skip else [])
               + (["-c", str(a.count)] if a.count else []) + a.command)
        with open(a.log, "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc:
            print(f"ncu exited {rc} (see {a.log})", file=sys.stderr)
    ncu_summary(a.summary or a.log)
    return 0


def trace_events(prof) -> list:
    """The events of a finished torch.profiler run, as its Chrome trace lists them."""
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(os.path.join(d, "trace.json"))
        with open(os.path.join(d, "trace.json")) as fh:
            return json.load(fh)["traceEvents"]


def cmd_mem(a):
    """Peak memory of a training step (forward, then backward) per op and shape, above its inputs: the allocations a
    GPU run makes, counted by torch.profiler on CPU tensors while the stand-in driver compiles and runs nothing."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    import chunkwise
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from shapes import resolve
    install_sm90(ptx_only=True)
    for s in resolve(a.shapes):
        for fam in a.ops.split(","):
            chunk_op = FAMILIES[fam][0]
            args = op_inputs(fam, s.B, s.T, s.H, s.HV, s.K, s.V, torch.bfloat16, True)
            do = torch.zeros(s.B, s.T, s.HV, s.V, dtype=torch.bfloat16)
            cu = None if s.cu_seqlens is None else torch.tensor(s.cu_seqlens, dtype=torch.int32)

            def step():
                o, _ = getattr(chunkwise, chunk_op)(*args, cu_seqlens=cu, backend="triton")
                o.backward(do)
                for t in args:
                    t.grad = None
            step()          # (compiles)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step()
            events = [e["args"] for e in trace_events(prof) if e.get("name") == "[memory]"]
            start = events[0]["Total Allocated"] - events[0]["Bytes"]
            peak = max(e["Total Allocated"] for e in events) - start
            print(f"{s.name:24} {fam:6} {peak / 2**20:9.1f} MiB", flush=True)
    return 0


def cmd_timeline(a):
    """Kernel start / end per stream of a forward call, eager and replayed from a CUDA graph (GPU only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    if not torch.cuda.is_available():
        sys.exit("timeline: needs a CUDA GPU (it profiles the kernels as they run)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    from shapes import make_inputs, resolve
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")   # as triton.testing.do_bench clears L2
    for s in resolve(a.shapes):
        for op in a.ops.split(","):
            x = make_inputs(op, s, torch.bfloat16, "cuda")
            fn = lambda: common.run_chunkwise(op, x, "triton")       # noqa: E731
            if a.train:         # a training step: forward, then backward into the leaves' gradients
                leaves = [t.requires_grad_() for t in common._args(op, x) if t.is_floating_point()]
                do = torch.randn_like(x["v"])

                def fn():
                    common.run_chunkwise(op, x, "triton")[0].backward(do)
                    for t in leaves:
                        t.grad = None
            fn()
            modes = [("eager", fn)]
            try:
                modes.append(("graph", common.capture(fn).replay))
            except Exception as e:  # noqa: BLE001
                print(f"{s.name} {op}: not captured in a CUDA graph ({type(e).__name__}: {e})"[:200])
            for mode, call in modes:
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.calls):
                        torch.cuda._sleep(1000)         # (marks where a call starts: its kernel is spin_kernel)
                        flush.zero_()
                        call()
                    torch.cuda.synchronize()
                ks = sorted((e for e in trace_events(prof) if e.get("cat") == "kernel"), key=lambda e: e["ts"])
                calls, cur = [], []
                for e in ks:            # a call: the kernels after a marker and its flush
                    if "spin_kernel" in e["name"]:
                        cur = []
                        calls.append(cur)
                    elif calls:
                        cur.append(e)
                calls = [c[1:] for c in calls if len(c) > 1]
                for i, c in enumerate(calls):
                    t0 = min(e["ts"] for e in c)
                    t1 = max(e["ts"] + e["dur"] for e in c)
                    print(f"{s.name} {op} {mode} call {i}: {t1 - t0:8.1f} us from first start to last end")
                    for e in c:
                        name = re.sub(r"^(void )?", "", e["name"])[:48]
                        print(f"    stream {e['args'].get('stream', '?'):>3}  {e['ts'] - t0:8.1f} .. "
                              f"{e['ts'] + e['dur'] - t0:8.1f} us  ({e['dur']:7.1f})  {name}  "
                              f"grid {e['args'].get('grid', '')}")
    return 0


# ----------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ptx", help="build every case's kernels for sm_90 and record their normalized PTX")
    p.add_argument("--out", required=True)
    p.add_argument("--src", help="a src/ directory to import chunkwise from (another tree)")
    p.add_argument("--cases", help="only the cases whose name matches this regex")
    p.add_argument("--list", action="store_true", help="list the cases and stop")
    p.add_argument("--jobs", type=int, default=1, help="processes (by family; only where cores are idle)")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_ptx)
    p = sub.add_parser("ptx-diff", help="compare two ptx outputs; exit 1 if a launch differs")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--context", type=int, default=8, help="diff lines shown per differing build (x3)")
    p.add_argument("--max", type=int, default=3, help="differing builds shown per kernel")
    p.add_argument("--cases", help="only the cases whose name matches this regex (e.g. a subset run's)")
    p.set_defaults(fn=cmd_diff)
    p = sub.add_parser("warm", help="fill and pack Triton's cache for an sm_90 device run (real ptxas)")
    p.add_argument("--cases", help="the ptx cases whose name matches this regex")
    p.add_argument("--out", default=".triton_sm90/cache.tgz", help="the packed cache (git-ignored; carry it)")
    p.add_argument("pytest_args", nargs="*", help="tests to run on CPU tensors at their GPU sizes (after --)")
    p.set_defaults(fn=cmd_warm)
    p = sub.add_parser("sass", help="registers, spills, instruction counts of a cache dir or a ptx output dir")
    p.add_argument("path")
    p.add_argument("--kernel", help="only the kernels whose label matches this regex")
    p.add_argument("--lines", type=int, default=0, help="the N source lines with the most static instructions")
    p.set_defaults(fn=cmd_sass)
    p = sub.add_parser("mem", help="peak memory of a training step per op and shape, on CPU tensors")
    p.add_argument("--ops", default="gdn,kda,delta,gla")
    p.add_argument("--shapes", default="B1-T32768-H2-HV8", help="names or sets of benchmarks/shapes.py")
    p.set_defaults(fn=cmd_mem)
    p = sub.add_parser("ncu", help="run a command under Nsight Compute and summarize its report")
    p.add_argument("--kernels", help="regex of the kernels to profile")
    p.add_argument("--skip", type=int, default=0, help="launches to skip first (e.g. a compiling first call)")
    p.add_argument("--count", type=int, default=0, help="launches to profile")
    p.add_argument("--log", default="ncu.log")
    p.add_argument("--summary", help="only summarize this existing report")
    p.add_argument("command", nargs="*")
    p.set_defaults(fn=cmd_ncu)
    p = sub.add_parser("timeline", help="kernel start / end per stream of a forward call, eager and from a graph")
    p.add_argument("--ops", default="gdn")
    p.add_argument("--shapes", default="B1-T32768-H32", help="names or sets of benchmarks/shapes.py")
    p.add_argument("--calls", type=int, default=3, help="calls of each mode profiled")
    p.add_argument("--train", action="store_true", help="a training step (forward and backward), not the forward")
    p.set_defaults(fn=cmd_timeline)
    a = ap.parse_args()
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
