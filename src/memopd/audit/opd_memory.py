"""Peak extra memory of the OPD term (forward + backward), chunked vs naive full logits.

Each measurement runs in a fresh subprocess and reads the peak resident set size (CPU) or the CUDA
allocator's peak, minus the baseline after the inputs and heads exist. The naive version (full
(N, V) logits for student and teacher) is measured at small N and scaled linearly, because at
N = 8,192, V = 151,936 it needs ~20 GB+, more than a small machine holds.
"""
from __future__ import annotations

import json
import subprocess
import sys

_CHILD = r"""
import json, resource, sys, torch
from memopd.losses import opd_loss, reverse_kl
n, v, h, chunk, naive, device = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
torch.manual_seed(0)
s_head = torch.nn.Linear(h, v, bias=False, device=device)
t_head = torch.nn.Linear(h, v, bias=False, device=device).requires_grad_(False)
hs = torch.randn(n, h, device=device, requires_grad=True)
ht = torch.randn(n, h, device=device)
def peak():
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
base = peak() if device == "cuda" else None
import psutil
rss0 = psutil.Process().memory_info().rss
if naive:
    ls = torch.log_softmax(s_head(hs).float(), -1); lt = torch.log_softmax(t_head(ht).float(), -1)
    loss = (ls.exp() * (ls - lt)).sum(-1).mean()
else:
    loss, _ = opd_loss(hs, s_head, ht, t_head, chunk_size=chunk)
loss.backward()
if device == "cuda":
    torch.cuda.synchronize(); extra = peak() - base
else:
    extra = peak() - rss0
grad_bytes = s_head.weight.grad.numel() * 4 + hs.grad.numel() * 4
print(json.dumps({"n": n, "vocab": v, "hidden": h, "chunk": chunk, "naive": naive, "device": device,
                  "extra_bytes": extra, "grad_bytes": grad_bytes}))
"""


def measure(n: int, vocab: int, hidden: int, chunk: int, naive: bool, device: str = "cpu") -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(n), str(vocab), str(hidden), str(chunk),
                          "1" if naive else "0", device], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(n: int = 8192, vocab: int = 151_936, hidden: int = 256, chunk: int = 128, naive_n: int = 512,
        device: str = "cpu", log=print) -> list[dict]:
    rows = [measure(n, vocab, hidden, chunk, naive=False, device=device)]
    small = measure(naive_n, vocab, hidden, chunk, naive=True, device=device)
    small_chunked = measure(naive_n, vocab, hidden, chunk, naive=False, device=device)
    # the logits part scales with N; the gradient of the head does not
    grow = (small["extra_bytes"] - small["grad_bytes"]) * n / naive_n
    scaled = dict(small, n=n, extra_bytes=grow + small["grad_bytes"], scaled_from=naive_n)
    rows += [small_chunked, small, scaled]
    gib = 2**30
    for r in rows:
        kind = "naive full logits" if r["naive"] else f"chunked ({r['chunk']} rows)"
        note = f" (scaled from N={r['scaled_from']})" if "scaled_from" in r else ""
        log(f"OPD fwd+bwd N={r['n']:>5} V={r['vocab']} H={r['hidden']} {kind:<22}: "
            f"peak extra {r['extra_bytes'] / gib:6.2f} GiB{note}  (of which gradients {r['grad_bytes'] / gib:.2f} GiB)")
    return rows
