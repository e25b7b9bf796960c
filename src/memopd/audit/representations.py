"""How other trainers lay out the same episodes, side by side with our packer: each layout's representation error
against the exact states (the batch audit, memopd.audit.batch) and its cost, packed tokens and forward + backward
time, measured interleaved in the same repeats (memopd.audit.packing_bench.interleaved_times) so that a ratio to
ours cancels a slow spell of the machine.

  ours               memopd.packing, exact layout: the prefix once, each call at its own positions and visibility
  one row per call   the exact state of each call alone (verl / SkyRL / tinker without prefix sharing)
  persistent         one row per episode, the persistent-history transcript (a context manager keeping history)
  mem1 stitched      one row per episode, each call's own tokens visible (MEM1's 2-D mask) at running positions
  trl tree           TRL 1.16.0's AsyncGRPO packer (a prefix trie over the calls), when trl is installed
"""
from __future__ import annotations

import math

import torch

from memopd.audit.adapters import BatchRow, exact_packer, packed_rows, persistent_packer
from memopd.audit.batch import audit
from memopd.audit.packing_bench import interleaved_times
from memopd.ledger import LedgerEpisode
from memopd.progress import Progress
from memopd.stats import ratio_interval


def per_call_rows(episodes) -> list[BatchRow]:
    rows = []
    for e, ep in enumerate(episodes):
        for t, inv in enumerate(ep.invocations):
            ids, n = inv.input_ids + inv.output_ids, len(inv.input_ids)
            rows.append(BatchRow(ids, list(range(len(ids))), list(range(n - 1, len(ids) - 1)), list(inv.output_ids),
                                 [None] * len(inv.output_ids), None, f"episode {e} call {t}"))
    return rows


def stitched_rows(episodes) -> list[BatchRow]:
    from memopd.packing import pack

    return packed_rows([pack(ep, layout="corrupt_positions") for ep in episodes])


def trl_tree_rows(episodes) -> list[BatchRow] | None:
    try:
        from trl.experimental.async_grpo.packing import TreeRow
    except ImportError:
        return None
    from memopd.audit.adapters import trl_rows

    out = []
    for ep in episodes:
        row = TreeRow()
        for inv in ep.invocations:
            row.add({"input_ids": torch.tensor(inv.input_ids + inv.output_ids),
                     "completion_mask": torch.tensor([0] * len(inv.input_ids) + [1] * len(inv.output_ids)),
                     "old_log_probs": torch.zeros(len(inv.input_ids) + len(inv.output_ids)), "advantage": 1.0,
                     "group_id": ep.task_id})
        out += trl_rows([{k: v.tolist() for k, v in row.pack().items()}])
    return out


LAYOUTS = {"ours": exact_packer, "one row per call": per_call_rows, "persistent": persistent_packer,
           "mem1 stitched": stitched_rows, "trl tree": trl_tree_rows}


def forward_backward(model, rows: list[BatchRow]) -> None:
    """One training pass over the rows as the trainer runs it: forward with the row's mask and positions, the sum of
    the loss tokens' negative log-probs, backward."""
    from memopd.attention import attn_impl, lm_logits

    model.zero_grad(set_to_none=True)
    with attn_impl(model, "sdpa"):
        for row in rows:
            h = model.get_decoder()(input_ids=torch.tensor([row.input_ids]), position_ids=torch.tensor([row.position_ids]),
                                    attention_mask=row.allowed()[None, None], use_cache=False).last_hidden_state[0]
            logits = lm_logits(model, h[torch.tensor(row.pred_index)])
            loss = -torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(row.target_id)[:, None]).sum()
            loss.backward()


def compare_layouts(model, episodes: list[LedgerEpisode], repeats: int = 3, label: str = "") -> list[dict]:
    """One row per layout: where its loss tokens land, its representation error, packed tokens and time vs ours."""
    records = [e.to_episode() for e in episodes]
    made = {name: fn(records) for name, fn in LAYOUTS.items()}
    made = {k: v for k, v in made.items() if v is not None}
    bar = Progress(f"layouts[{label}]", (1 + repeats) * len(made), "forward+backward runs")
    times = interleaved_times({k: (lambda rows=v: forward_backward(model, rows)) for k, v in made.items()}, repeats,
                              progress=bar)
    bar.close()
    model.zero_grad(set_to_none=True)
    tokens = {k: sum(len(r.input_ids) for r in v) for k, v in made.items()}
    out = []
    for name, rows in made.items():
        with torch.no_grad():
            r = audit(model, rows, episodes)
        rep, c = r["numbers"]["representation"], r["placement"]["counts"]
        speed, lo, hi = ratio_interval(times["ours"], times[name])
        out.append({"episodes": label, "layout": name, "rows": len(rows), "packed_tokens": tokens[name],
                    "tokens_vs_ours": tokens[name] / tokens["ours"], "fwd_bwd_s": sorted(times[name])[len(times[name]) // 2],
                    "time_vs_ours": 1 / speed if speed else math.nan, "time_vs_ours_lo": 1 / hi if hi else math.nan,
                    "time_vs_ours_hi": 1 / lo if lo else math.nan, "exact_tokens": c["exact"],
                    "off_state_tokens": sum(v for k, v in c.items() if k != "exact"),
                    "p99_abs_dlogp": rep["p99_abs_dlogp"], "max_abs_dlogp": rep["max_abs_dlogp"],
                    "false_clip_0.2": rep["false_clip_0.2"], "trains_once": r["placement"]["trains_once"],
                    "repeats": repeats, "threads": torch.get_num_threads()})
    return out
