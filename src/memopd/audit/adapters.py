"""Other trainers' training batches as the rows a model scores (`BatchRow`): for every loss-carrying token, the
position whose logits the trainer reads for it, the token, and the batch's own old log-prob, with the row's token
ids, positions and visibility. `memopd audit batch` checks such rows against the exact call ledger.

The batch is a JSON file of the framework's own field names (docs/audit-your-batch.md shows how to dump one):

  verl     DataProto's tensors, one row each: input_ids, attention_mask, position_ids [B, P+R]; responses,
           response_mask, rollout_log_probs [B, R] (the last R columns of input_ids are the response)
           (verl/protocol.py, verl/experimental/agent_loop/agent_loop.py at b178a3c)
  skyrl    GeneratorOutput: prompt_token_ids, response_ids, loss_masks, rollout_logprobs (ragged, one per sample)
           (skyrl/train/generators/base.py at a956457)
  trl      AsyncGRPO's packed rows, TreeRow.pack() of trl 1.16.0 (trl/experimental/async_grpo/packing.py): the
           samples folded into a prefix trie, input_ids, position_ids, shift_labels [N]; token_index, old_log_probs
           [M]; tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k (each segment sees its root-to-segment path)
  tinker   a list of Datum: model_input (tokens [N]); loss_fn_inputs target_tokens, logprobs, mask [N]: the
           target at k is predicted at input position k; one datum holds consecutive calls whose observation
           extends it (tinker_cookbook/rl/data_processing.py at 9dfcc3a)
  mem1     MEM1's stitched episodes: input_ids, position_ids [L], attention_mask_4d [L, L] (1 = may attend),
           loss_mask [L] (1 = a model token that carries loss), old_log_probs [L] (at the token's position)
           (Mem1/train/rollout/llm_agent/generation_think.py at 6f22061: _compose_final_output)
  rows     this module's own layout: input_ids, position_ids, pred_index, target_id, old_log_probs, and `mask`
           [L, L] or `document` [L] (none: causal over the row)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


class BatchFormatError(ValueError):
    """A batch that lacks a field its format needs, or whose fields disagree: the message names the row and field."""


@dataclass
class BatchRow:
    input_ids: list[int]
    position_ids: list[int]
    pred_index: list[int]  # the position whose logits predict each loss-carrying token
    target_id: list[int]
    old_logprobs: list[float | None]
    mask: torch.Tensor | None = None  # (L, L) bool: query i may attend key j; None: causal over the row
    where: str = ""

    def allowed(self) -> torch.Tensor:
        n = len(self.input_ids)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return causal if self.mask is None else (self.mask.bool() & causal)


def _need(d: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise BatchFormatError(f"{where}: no field {missing[0]!r} (needs {list(keys)})")


def _row(ids, pos, pred, tgt, old, mask, where) -> BatchRow:
    n = len(ids)
    if len(pos) != n:
        raise BatchFormatError(f"{where}: {len(pos)} positions for {n} tokens")
    if not len(pred) == len(tgt) == len(old):
        raise BatchFormatError(f"{where}: {len(pred)} pred_index, {len(tgt)} targets, {len(old)} old log-probs")
    bad = [p for p in pred if not 0 <= p < n]
    if bad:
        raise BatchFormatError(f"{where}: pred_index {bad[0]} outside the row's {n} tokens")
    return BatchRow([int(x) for x in ids], [int(x) for x in pos], [int(p) for p in pred], [int(t) for t in tgt],
                    [None if v is None else float(v) for v in old], mask, where)


def verl_rows(d: dict) -> list[BatchRow]:
    _need(d, ("input_ids", "attention_mask", "position_ids", "response_mask"), "verl batch")
    rows = []
    for b, (ids, att, pos, rmask) in enumerate(zip(d["input_ids"], d["attention_mask"], d["position_ids"],
                                                   d["response_mask"])):
        where = f"verl row {b}"
        lps = (d.get("rollout_log_probs") or [None] * len(d["input_ids"]))[b] or [None] * len(rmask)
        start = len(ids) - len(rmask)  # the response occupies the last R columns
        keep = [i for i, a in enumerate(att) if a]  # padding dropped: its tokens are never attended
        at = {i: k for k, i in enumerate(keep)}
        pred, tgt, old = [], [], []
        for j, m in enumerate(rmask):
            i = start + j
            if m and att[i]:
                if i - 1 not in at:
                    raise BatchFormatError(f"{where}: response token {j} has no attended token before it")
                pred.append(at[i - 1]), tgt.append(ids[i]), old.append(lps[j])
        rows.append(_row([ids[i] for i in keep], [pos[i] for i in keep], pred, tgt, old, None, where))
    return rows


def skyrl_rows(d: dict) -> list[BatchRow]:
    _need(d, ("prompt_token_ids", "response_ids", "loss_masks"), "skyrl batch")
    rows = []
    for b, (p, r, lm) in enumerate(zip(d["prompt_token_ids"], d["response_ids"], d["loss_masks"])):
        lps = (d.get("rollout_logprobs") or [None] * len(d["response_ids"]))[b] or [None] * len(r)
        if len(lm) != len(r):
            raise BatchFormatError(f"skyrl sample {b}: {len(lm)} loss_masks for {len(r)} response tokens")
        ids = list(p) + list(r)
        idx = [j for j, m in enumerate(lm) if m]
        rows.append(_row(ids, list(range(len(ids))), [len(p) + j - 1 for j in idx], [r[j] for j in idx],
                         [lps[j] for j in idx], None, f"skyrl sample {b}"))
    return rows


def tree_mask(n: int, kv_index: list[int], cu_q: list[int], cu_k: list[int]) -> torch.Tensor:
    """(L, L) bool of TRL's tree attention: a query of segment s sees the K/V of its root-to-segment path
    (tree_kv_index[cu_k[s]:cu_k[s+1]]), causally within its own segment."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        path = torch.tensor(kv_index[cu_k[s]:cu_k[s + 1]], dtype=torch.long)
        for i in range(cu_q[s], cu_q[s + 1]):
            mask[i, path[path <= i]] = True
    return mask


def trl_rows(d: list) -> list[BatchRow]:
    rows = []
    for b, r in enumerate(d):
        where = f"trl row {b}"
        _need(r, ("input_ids", "position_ids", "shift_labels", "token_index", "tree_kv_index", "tree_cu_seqlens_q",
                  "tree_cu_seqlens_k"), where)
        labels, idx = r["shift_labels"], r["token_index"]
        bad = [i for i in idx if not 0 <= i < len(labels) or labels[i] < 0]
        if bad:
            raise BatchFormatError(f"{where}: token_index {bad[0]} has no label in shift_labels")
        old = r.get("old_log_probs") or [None] * len(idx)
        rows.append(_row(r["input_ids"], r["position_ids"], idx, [labels[i] for i in idx], old,
                         tree_mask(len(r["input_ids"]), r["tree_kv_index"], r["tree_cu_seqlens_q"],
                                   r["tree_cu_seqlens_k"]), where))
    return rows


def tinker_rows(d: list) -> list[BatchRow]:
    rows = []
    for b, datum in enumerate(d):
        where = f"tinker Datum {b}"
        _need(datum, ("model_input", "loss_fn_inputs"), where)
        ins = datum["loss_fn_inputs"]
        _need(ins, ("target_tokens", "mask"), where + " loss_fn_inputs")
        tokens = datum["model_input"]["tokens"] if isinstance(datum["model_input"], dict) else datum["model_input"]
        lps = ins.get("logprobs") or [None] * len(tokens)
        idx = [k for k, m in enumerate(ins["mask"]) if m]
        rows.append(_row(tokens, list(range(len(tokens))), idx, [ins["target_tokens"][k] for k in idx],
                         [lps[k] for k in idx], None, where))
    return rows


def mem1_rows(d: list) -> list[BatchRow]:
    rows = []
    for b, e in enumerate(d):
        where = f"mem1 episode {b}"
        _need(e, ("input_ids", "position_ids", "attention_mask_4d", "loss_mask"), where)
        old = e.get("old_log_probs") or [None] * len(e["input_ids"])
        idx = [k for k, m in enumerate(e["loss_mask"]) if m and k > 0]
        mask = torch.tensor(e["attention_mask_4d"], dtype=torch.bool)
        if mask.shape != (len(e["input_ids"]),) * 2:
            raise BatchFormatError(f"{where}: attention_mask_4d is {tuple(mask.shape)}, not L x L")
        rows.append(_row(e["input_ids"], e["position_ids"], [k - 1 for k in idx], [e["input_ids"][k] for k in idx],
                         [old[k] for k in idx], mask, where))
    return rows


def own_rows(d: list) -> list[BatchRow]:
    rows = []
    for b, r in enumerate(d):
        where = f"row {b}"
        _need(r, ("input_ids", "position_ids", "pred_index", "target_id"), where)
        mask = (torch.tensor(r["mask"], dtype=torch.bool) if "mask" in r else
                (torch.tensor(r["document"])[:, None] == torch.tensor(r["document"])[None, :]) if "document" in r
                else None)
        rows.append(_row(r["input_ids"], r["position_ids"], r["pred_index"], r["target_id"],
                         r.get("old_log_probs") or [None] * len(r["target_id"]), mask, where))
    return rows


ADAPTERS = {"verl": verl_rows, "skyrl": skyrl_rows, "trl": trl_rows, "tinker": tinker_rows, "mem1": mem1_rows,
            "rows": own_rows}


def read_batch(path: str | Path, fmt: str) -> list[BatchRow]:
    """A dumped batch (JSON of the framework's fields) as rows; BatchFormatError names what is wrong where."""
    if fmt not in ADAPTERS:
        raise BatchFormatError(f"unknown batch format {fmt!r}; choose from {sorted(ADAPTERS)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BatchFormatError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    try:
        return ADAPTERS[fmt](data)
    except (TypeError, KeyError, IndexError) as e:  # a field of the wrong shape: named, not a traceback
        raise BatchFormatError(f"{path}: not a {fmt} batch ({type(e).__name__}: {e})") from None


def packed_rows(packs) -> list[BatchRow]:
    """Packed sequences of memopd.packing (ours, in any of its layouts) as rows: each sampled action token predicted
    at its gamma index, with the pack's positions and visibility."""
    rows = []
    for b, p in enumerate(packs):
        idx = torch.arange(len(p))
        rows.append(BatchRow(p.input_ids.tolist(), p.position_ids.tolist(), p.pred_index.tolist(), p.targets.tolist(),
                             [None] * int(p.act_mask.sum()), p.visible(idx[:, None], idx[None, :]),
                             f"pack {b} ({p.layout})"))
    return rows


def exact_packer(episodes) -> list[BatchRow]:
    """Our packer as a certify target: each episode packed in the exact layout (memopd.packing)."""
    from memopd.packing import pack

    return packed_rows([pack(ep) for ep in episodes])


def persistent_packer(episodes) -> list[BatchRow]:
    """The persistent-history flattening (one transcript per episode): a packer that must fail certification."""
    from memopd.packing import pack

    return packed_rows([pack(ep, layout="persistent") for ep in episodes])
