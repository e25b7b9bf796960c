"""flex attention on CUDA over packs of several lengths, as training meets them: which path `auto` picks for each,
how many graphs torch.compile builds for flex (each new pack length may recompile; past Dynamo's recompile limit
transformers' compiled flex falls back to eager, which materialises L x L scores), and the peak GPU memory of a
forward + backward. A tiny Qwen2 with Qwen2.5-3B's heads (16 query, 2 KV, head dim 128), bf16 autocast. Prints the
figures, "pass: ..." last; exit 75 (skip) without a CUDA GPU.

    python tests/gpu/flex_probe.py
"""
from __future__ import annotations

import random
import sys

LENGTHS = (6, 9, 12, 15, 18)  # calls per pack: packed lengths from ~2k to ~6k tokens, none repeated


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("skip: no CUDA GPU (torch.cuda.is_available() is false)")
        return 75
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from memopd.attention import choose_backend, packed_logits
    from memopd.packing import pack
    from memopd.synthetic import random_episode

    cfg = Qwen2Config(vocab_size=32000, hidden_size=2048, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768)
    model = Qwen2ForCausalLM(cfg).cuda()
    rng = random.Random(0)
    pool = list(range(100, 30000))
    rows = []
    for calls in LENGTHS:
        p = pack(random_episode(rng, pool, "summary_replacement", calls, 256, (64, 256), (32, 128)))
        torch.cuda.reset_peak_memory_stats()
        before = counters["stats"]["unique_graphs"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            chosen = choose_backend(model, p)
            logits = packed_logits(model, p, "flex")
        logits.float().logsumexp(-1).sum().backward()
        model.zero_grad(set_to_none=True)
        rows.append((p.input_ids.numel(), chosen, counters["stats"]["unique_graphs"] - before,
                     torch.cuda.max_memory_allocated() / 2**30))
        print(f"pack of {rows[-1][0]} tokens: auto chose {chosen}; flex compiled {rows[-1][2]} new graphs; "
              f"peak {rows[-1][3]:.2f} GiB", flush=True)
    compiled = sum(r[2] for r in rows)
    print(f"pass: {len(rows)} pack lengths ({rows[0][0]}-{rows[-1][0]} tokens), flex compiled {compiled} graphs in "
          f"all, peak {max(r[3] for r in rows):.2f} GiB; auto chose {sorted({r[1] for r in rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
