"""A PPO batch spread over ranks: who holds which episode, the minibatches every rank draws alike, the passes
a rank runs in each, and how the ranks' shares of the metrics combine.

Positions: an episode's position in the whole batch (0..B-1, all ranks); rank r holds `owners[r]`. The
minibatch order is drawn over the whole batch from the seed, so every rank knows every minibatch and its
token counts (the loss denominators) without holding its episodes.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from memopd.dist import gather


@dataclass(frozen=True)
class BatchLayout:
    """Which rank holds which episodes: `ids[i]` is the batch position of this rank's episode i, `owners[r]`
    the positions rank r holds."""
    ids: list[int]
    owners: list[list[int]]

    @classmethod
    def gathered(cls, ids: list[int]) -> BatchLayout:
        return cls(ids, gather(ids))

    @property
    def local(self) -> dict[int, int]:
        """Batch position -> index into this rank's episodes."""
        return {pos: i for i, pos in enumerate(self.ids)}

    @property
    def size(self) -> int:
        return sum(len(o) for o in self.owners)


@dataclass(frozen=True)
class Minibatch:
    episodes: list[int]  # batch positions
    actions: int  # sampled action tokens of its episodes: the PPO, entropy and value denominator
    teacher_tokens: int  # its teacher-mask tokens: the OPD denominator


def token_counts(local: list[tuple[int, int, int]]) -> tuple[dict[int, int], dict[int, int]]:
    """`local`: (batch position, action tokens, teacher tokens) of this rank's episodes -> the action and the
    teacher tokens of every episode of the batch (all ranks), by batch position."""
    actions, teacher = {}, {}
    for part in gather(local):
        for pos, n_actions, n_teacher in part:
            actions[pos], teacher[pos] = n_actions, n_teacher
    return actions, teacher


def minibatch_schedule(actions: dict[int, int], teacher: dict[int, int], epochs: int, size: int,
                       seed: int) -> list[list[Minibatch]]:
    """Every epoch's minibatches of `size` batch positions: one generator seeded by `seed` shuffles the batch
    before each epoch (the previous epoch's order), so every rank draws the same minibatches."""
    order = list(range(len(actions)))
    rng = random.Random(seed)
    schedule = []
    for _ in range(epochs):
        rng.shuffle(order)
        chunks = [order[i : i + size] for i in range(0, len(order), size)]
        schedule.append([Minibatch(idx, sum(actions[g] for g in idx), sum(teacher[g] for g in idx))
                         for idx in chunks])
    return schedule


def minibatch_plan(idx: list[int], local: dict[int, int], owners: list[list[int]],
                   pad: bool) -> list[tuple[int, bool]]:
    """This rank's passes for minibatch `idx` (batch positions): (index into its episodes, real?).
    `local`: this rank's batch position -> index; `owners[r]`: rank r's batch positions. With `pad`
    (FSDP: every forward and backward is a collective) every rank runs as many passes as the rank
    holding most of the minibatch, the extra ones on its first episode with a zero loss (so every rank
    needs one episode: train_run requires batch_tasks >= ranks)."""
    mine = [(local[g], True) for g in idx if g in local]
    if not pad:
        return mine
    most = max(sum(g in set(o) for g in idx) for o in owners)
    return mine + [(0, False)] * (most - len(mine))


MAX_METRICS = ("ppo/ratio_max", "opd/kl_max")  # combined by max; every other per-episode metric adds up


def combine(into: dict, metrics: dict) -> None:
    """Add one episode's (or rank's) share of a minibatch's metrics: each loss term is already divided
    by the minibatch's token count, so the shares sum to the minibatch value."""
    for k, v in metrics.items():
        v = float(v)
        into[k] = max(into.get(k, v), v) if k in MAX_METRICS else into.get(k, 0.0) + v


@dataclass(frozen=True)
class RankShare:
    """One rank's part of the update's metrics (gathered by every rank)."""
    minibatches: list[dict]  # its share of each minibatch's metrics
    packed_tokens: int
    actions: int
    reward: float  # task scores, summed over its episodes
    kl_ref: float  # reference penalties, summed over its action tokens
    first_ratio_err: float


def reduce_metrics(share: RankShare, n_episodes: int) -> dict:
    """Every rank's shares combined per minibatch (the grad norms, the same on every rank, counted once),
    then averaged over the minibatches; batch totals, and means over the `n_episodes` episodes."""
    everyone = gather(share)
    minibatches = []
    for k in range(len(share.minibatches)):  # every rank ran the same minibatches
        mb: dict[str, float] = {}
        for rank, other in enumerate(everyone):
            combine(mb, {key: v for key, v in other.minibatches[k].items() if not (rank and key.endswith("grad_norm"))})
        minibatches.append(mb)
    metrics = {}
    for key in sorted({key for mb in minibatches for key in mb}):
        vals = [mb[key] for mb in minibatches if key in mb]
        metrics[key] = sum(vals) / len(vals)
    metrics["ppo/first_ratio_err"] = max(o.first_ratio_err for o in everyone)
    metrics["tokens/packed"] = int(sum(o.packed_tokens for o in everyone))
    metrics["tokens/actions"] = int(sum(o.actions for o in everyone))
    metrics["reward/task"] = sum(o.reward for o in everyone) / n_episodes
    metrics["reward/kl_ref"] = sum(o.kl_ref for o in everyone) / max(1, metrics["tokens/actions"])
    return metrics
