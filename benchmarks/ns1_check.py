"""One-stage stage 2 (num_stages=1) against the default, DeltaNet bf16 B1-H32 at T = 2048 / 32768, with and without
tensor descriptors: run on the GPU with CUDA_LAUNCH_BLOCKING=1 (session 12: an illegal memory access seen once in a
split run; this unsplit check printed 0.0 differences)."""
import torch, torch.nn.functional as F
from chunkwise.triton.chunk_fwd import chunk_fwd
torch.manual_seed(0)
for T in (2048, 32768):
    B, H, K = 1, 32, 128
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16)
    for tma in ("1", "0"):
        import os; os.environ["CHUNKWISE_FWD_TMA"] = tma
        o1, _ = chunk_fwd(q, k, v, None, beta, K ** -0.5, None, True, None, num_stages=1)
        torch.cuda.synchronize()
        o3, _ = chunk_fwd(q, k, v, None, beta, K ** -0.5, None, True, None)
        print("T", T, "tma", tma, "ns1 vs default", ((o1.float() - o3.float()).norm() / o3.float().norm()).item(), flush=True)
