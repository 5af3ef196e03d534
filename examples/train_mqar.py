"""Train a 2-layer Gated DeltaNet language model on multi-query associative recall (MQAR).

Each sequence lists ``n_kv`` key-value pairs, then asks for ``n_q`` of the keys again, each
followed by its value:

    k₁ v₁ k₂ v₂ … k_n v_n | k_a v_a k_b v_b …        keys from [1, vocab/2), values from [vocab/2, vocab)

The loss is the cross-entropy of predicting v after its key in the query part (all other
positions are ignored), so chance level is ln(vocab/2) and a model that recalls every pair
reaches ~0. A linear-attention layer has to write each pair into its state and read it back: the
delta rule does that well.

Model: embedding → 2 × [RMSNorm → chunkwise.layers.GatedDeltaNet → +, RMSNorm → SwiGLU → +] →
RMSNorm → tied output head. Optimiser: AdamW with a linear warm-up and cosine decay.

    python examples/train_mqar.py                      # CPU config: about a minute on 2 cores
    python examples/train_mqar.py --config gpu         # bigger, on a GPU (triton backend)
    python examples/train_mqar.py --backend triton     # the Triton kernels (interpreter on CPU: slow)

Prints the loss and recall accuracy, writes the loss curve (loss.png) and the history (history.json)
to --out (default: chunkwise-mqar in the system's temporary folder); exits non-zero if the final loss
is above the config's threshold.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chunkwise.layers import GatedDeltaNet, RMSNorm


@dataclass
class Config:
    vocab: int = 32          # keys 1..vocab/2-1, values vocab/2..vocab-1 (token 0 unused)
    n_kv: int = 4            # pairs in the context
    n_q: int = 4             # queries (distinct keys of the context)
    d_model: int = 64
    n_layers: int = 2
    heads: int = 2
    head_dim: int = 32
    batch: int = 64
    steps: int = 700
    lr: float = 5e-3
    weight_decay: float = 0.1
    warmup: int = 30
    threshold: float = 0.05  # the final loss (mean of the last 20 steps) must fall below this
    chunk_size: int = 32


CONFIGS = {
    # CPU: 16 tokens; recall is near perfect after ~250 steps
    "cpu": Config(),
    # the test's short run (tests/test_train_example.py)
    "short": Config(vocab=16, batch=16, steps=150, threshold=1.0, chunk_size=16),
    # the test's backend comparison (the triton backend runs under the interpreter on CPU)
    "tiny": Config(vocab=16, d_model=32, heads=2, head_dim=16, batch=4, steps=2, chunk_size=16),
    # GPU: 128 tokens, 32 pairs, a 4x wider model
    "gpu": Config(vocab=256, n_kv=32, n_q=32, d_model=256, heads=4, head_dim=64, batch=128, steps=2000, lr=2e-3,
                  warmup=100, threshold=0.05, chunk_size=64),
}


def mqar_batch(cfg: Config, generator: torch.Generator, device="cpu"):
    """Returns (tokens [B, L] int64, targets [B, L] int64 with -100 where no loss), L = 2·(n_kv + n_q)."""
    B, half = cfg.batch, cfg.vocab // 2
    keys = torch.stack([torch.randperm(half - 1, generator=generator)[:cfg.n_kv] + 1 for _ in range(B)])
    values = torch.randint(half, cfg.vocab, (B, cfg.n_kv), generator=generator)
    context = torch.stack([keys, values], dim=-1).reshape(B, -1)                       # k v k v …
    pick = torch.stack([torch.randperm(cfg.n_kv, generator=generator)[:cfg.n_q] for _ in range(B)])
    queries = torch.stack([keys.gather(1, pick), values.gather(1, pick)], dim=-1).reshape(B, -1)
    tokens = torch.cat([context, queries], dim=1)
    targets = torch.full_like(tokens, -100)
    q0 = 2 * cfg.n_kv
    targets[:, q0:-1:2] = tokens[:, q0 + 1::2]        # at each query key, predict its value
    return tokens.to(device), targets.to(device)


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: Config, layer_idx: int, backend: str):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.d_model), RMSNorm(cfg.d_model)
        self.mixer = GatedDeltaNet(cfg.d_model, num_k_heads=cfg.heads, num_v_heads=cfg.heads, head_k_dim=cfg.head_dim,
                                   head_v_dim=cfg.head_dim, layer_idx=layer_idx, backend=backend, mode="chunk",
                                   chunk_size=cfg.chunk_size)
        self.mlp = SwiGLU(cfg.d_model, 2 * cfg.d_model)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))[0]
        return x + self.mlp(self.norm2(x))


class GDNLM(nn.Module):
    def __init__(self, cfg: Config, backend: str = "auto"):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, i, backend) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()                                    # tied head


def train(cfg: Config, backend: str = "auto", device: str = "cpu", seed: int = 0, log_every: int = 20,
          quiet: bool = False):
    """Returns the history: a list of dicts {step, loss, acc, lr} (one per step)."""
    torch.manual_seed(seed)
    model = GDNLM(cfg, backend).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(seed + 1)
    history, start = [], time.time()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        tokens, targets = mqar_batch(cfg, gen, device)
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab).float(), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            m = targets != -100
            acc = (logits.argmax(-1)[m] == targets[m]).float().mean().item()
        history.append({"step": step, "loss": loss.item(), "acc": acc, "lr": lr_at(step)})
        if not quiet and (step % log_every == 0 or step == cfg.steps - 1):
            print(f"step {step:5d}  loss {loss.item():.4f}  recall acc {acc:.3f}  lr {lr_at(step):.2e}  "
                  f"{time.time() - start:6.1f}s", flush=True)
    return history


def final_loss(history, last: int = 20) -> float:
    tail = history[-last:]
    return sum(h["loss"] for h in tail) / len(tail)


def plot(history, path: str, cfg: Config, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    steps = [h["step"] for h in history]
    ax.semilogy(steps, [h["loss"] for h in history], lw=1, label="loss")
    ax.axhline(math.log(cfg.vocab // 2), color="gray", ls=":", label=f"chance ln({cfg.vocab // 2})")
    ax.axhline(cfg.threshold, color="red", ls="--", label=f"threshold {cfg.threshold}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on recalled values")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=list(CONFIGS), default="cpu")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None, help="override the config's number of steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "chunkwise-mqar"),
                   help="folder for loss.png and history.json (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="write the history only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    print(f"config {args.config}: {asdict(cfg)}  backend={args.backend} device={args.device}", flush=True)
    start = time.time()
    history = train(cfg, args.backend, args.device, args.seed)
    elapsed = time.time() - start
    loss = final_loss(history)
    acc = sum(h["acc"] for h in history[-20:]) / len(history[-20:])
    ok = loss < cfg.threshold
    print(f"final loss (mean of last 20 steps) {loss:.4f} (threshold {cfg.threshold}: {'PASS' if ok else 'FAIL'}), "
          f"recall accuracy {acc:.3f}, {elapsed:.1f}s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump({"config": asdict(cfg), "backend": args.backend, "device": args.device, "seconds": elapsed,
                   "final_loss": loss, "history": history}, f)
    if not args.no_plot:
        png = os.path.join(args.out, "loss.png")
        plot(history, png, cfg, f"MQAR, 2-layer GDN ({args.config}: {cfg.n_kv} pairs, vocab {cfg.vocab}), "
                                f"{args.backend} on {args.device}")
        print(f"saved {png}")
    print(f"saved {os.path.join(args.out, 'history.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
