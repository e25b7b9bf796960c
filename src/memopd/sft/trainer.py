"""The SFT trainer (one trainer for the student and the teacher initialisation).

Loss normalisation: the loss of an optimizer step is the mean over *all target tokens of that step*
(every micro-batch, every rank): each micro-batch contributes sum(NLL) / N_step, where N_step is
known before the step from the deterministic data plan. A long response therefore weighs more than
a short one (token-level mean, not a mean of per-example means).

Data order, schedule and resumption (see `StepPlan`): step s always sees the same bins; a checkpoint
stores the next step, so a run killed after its last checkpoint resumes there and, on CPU in fp32,
ends with the same weights as an uninterrupted run. AdamW (weight decay on matrices only, not on
norms/biases), linear warm-up then cosine decay to min_lr_ratio x lr, gradient clipping by global
norm, fp32 or bf16 autocast (fp32 master weights). Several GPUs: launched by torchrun
(WORLD_SIZE > 1); each rank takes every world-th bin of a step. `shard` says how the model lives on
the ranks, as `train.shard` does for training (memopd.parallel):
  none  a replica per rank, DistributedDataParallel (fp32 weights + grads + AdamW + DDP's buckets:
        20 bytes per parameter on every GPU, ~152 GB for the 7B teacher)
  fsdp  FSDP2 (`parallel.shard`): fp32 master weights, gradients and AdamW state sharded over the ranks
        (16 bytes per parameter / world); with bf16 the layers are gathered and compute in bf16
        (MixedPrecisionPolicy), gradients reduce-scattered in fp32 as a sum (the loss already carries
        1 / N_step). Every forward and backward is a collective: each rank runs grad_accum passes per
        step (every step is full, see StepPlan). Checkpoints hold whole tensors, gathered from the
        shards by every rank and written by rank 0 (tied weights stored once, as memopd.checkpoint's
        save_tensors does), so they load whatever the sharding; the final model is gathered likewise
        (`full_state_dict`).
`activation_checkpointing` recomputes every decoder layer in the backward (parallel.checkpoint_activations:
only each layer's input is kept), applied before sharding; the same loss and gradients.
"""
from __future__ import annotations

import hashlib
import math
import time
from contextlib import nullcontext
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from memopd import parallel
from memopd.dist import TIMEOUT_MIN, dist_info
from memopd.harness import Harness, Part, digest, run_identity
from memopd.packing import PackingLimitError
from memopd.records import Episode
from memopd.sft.data import LAYOUTS, StepPlan, bin_pack, example_len, target_len
from memopd.sft.loss import TargetLoss, target_loss

ROLES = ("student", "teacher")
NOT_TRAINER_KEYS = ("min_reward", "pretrain")  # keys of the `sft` config section used by other steps
# keys of a role's section read by the pipeline, not the trainer: `init` names the model the role starts from
ROLE_PIPELINE_KEYS = ("init",)
STAGES = ("sft", "pretrain")
SFT_FIELD_OF_KEY = {"backend": "attention"}  # sft keys spelt otherwise in TrainConfig


def stage_section(section: dict, stage: str) -> dict:
    """The `sft` config section as a training stage sees it. `pretrain` (language-model pre-training on
    the corpus before SFT) runs the same trainer with SFT's settings, its own per-role budgets and
    overrides from `sft.pretrain.{role}`, and no held-out split (all its data is plain text)."""
    if stage == "sft":
        return section
    if stage != "pretrain":
        raise ValueError(f"unknown training stage {stage!r} (one of {STAGES})")
    pre = section.get("pretrain") or {}
    base = {k: v for k, v in section.items() if k not in ROLES + NOT_TRAINER_KEYS}
    return {**base, "eval_fraction": 0.0, "eval_every": 0, **{r: pre[r] for r in ROLES if r in pre}}


def pretrain_steps(section: dict, role: str) -> int:
    """Budget of the role's pre-training stage in optimizer steps (0: the role starts SFT from its init)."""
    return int(((section.get("pretrain") or {}).get(role) or {}).get("steps", 0))


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int  # max tokens of one packed sequence (one micro-batch); an example never exceeds it
    grad_accum: int  # micro-batches per optimizer step (per rank)
    lr: float  # peak learning rate
    min_lr_ratio: float  # cosine floor, as a fraction of lr
    warmup_steps: int  # linear warm-up optimizer steps
    weight_decay: float
    betas: tuple[float, float]
    adam_eps: float
    clip: float  # max global gradient norm
    eval_fraction: float  # held-out fraction of source trajectories
    eval_every: int  # optimizer steps between held-out evaluations (0: only at the end)
    checkpoint_every: int  # optimizer steps between checkpoints
    precision: str  # fp32 | bf16 (autocast; weights and optimizer stay fp32)
    mode: str  # packed | padded (padded: each example its own row; the benchmark baseline)
    attention: str  # packed path (config key sft.backend): segmented (attention per example) or a memopd.attention path
    log_every: int  # optimizer steps between logged training metrics
    steps: int | None = None  # the budget: exactly one of steps / epochs
    epochs: float | None = None
    seed: int | None = None  # data order and RNG of this stage (None: the run's seed; the held-out split never changes)
    shard: str = "none"  # none (a replica per rank, DDP) | fsdp (FSDP2 shards over the ranks)
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward
    dist_timeout_min: float = TIMEOUT_MIN  # how long a rank waits in a collective (rank 0 writing a checkpoint)
    repeats: int = 0  # random-token sequences, each repeated, added to the training split (sft.data.repeat_examples)
    repeat_length: tuple[int, int] = (16, 96)  # [min, max] tokens of such a sequence
    layouts: tuple[str, ...] = ("exact",)  # the states of the turn examples trained on (sft.data.LAYOUTS)
    snapshots: tuple[int, ...] = ()  # optimizer steps after which the weights are also exported (`train(snapshot=)`)

    @property
    def dtype(self) -> str:
        """The compute precision as the trainers name it (parallel.PRECISIONS)."""
        return parallel.PRECISIONS[self.precision]

    @classmethod
    def from_section(cls, section: dict, role: str | None = None) -> "TrainConfig":
        """The `sft` config section with the role's overrides (budget, lr, ...) applied."""
        merged = {k: v for k, v in section.items() if k not in ROLES + NOT_TRAINER_KEYS}
        if role is not None:
            if role not in section:
                raise ValueError(f"sft config has no section for role {role!r}")
            merged.update({k: v for k, v in section[role].items() if k not in ROLE_PIPELINE_KEYS})
        merged = {SFT_FIELD_OF_KEY.get(k, k): v for k, v in merged.items()}
        names = {f.name for f in fields(cls)}
        if unknown := set(merged) - names:
            raise ValueError(f"unknown SFT config keys {sorted(unknown)}")
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if missing := required - set(merged):
            raise ValueError(f"SFT config lacks {sorted(missing)}")
        merged["betas"] = tuple(merged["betas"])
        for key in ("repeat_length", "layouts", "snapshots"):
            if key in merged:
                merged[key] = tuple(merged[key])
        cfg = cls(**merged)
        if (cfg.steps is None) == (cfg.epochs is None):
            raise ValueError("SFT config needs exactly one budget: steps or epochs")
        if cfg.precision not in parallel.PRECISIONS or cfg.mode not in ("packed", "padded"):
            raise ValueError(f"bad precision {cfg.precision!r} or mode {cfg.mode!r}")
        if cfg.repeats < 0 or not 1 <= cfg.repeat_length[0] <= cfg.repeat_length[1]:
            raise ValueError(f"sft.repeats {cfg.repeats} / repeat_length {list(cfg.repeat_length)}: "
                             "need repeats >= 0 and 1 <= min <= max")
        if cfg.repeats and 2 * cfg.repeat_length[1] + 2 > cfg.seq_len:  # the sequence twice, a separator and eos
            raise ValueError(f"sft.repeat_length {list(cfg.repeat_length)}: a repeat example of up to "
                             f"{2 * cfg.repeat_length[1] + 2} tokens exceeds seq_len {cfg.seq_len}")
        if not cfg.layouts or set(cfg.layouts) - set(LAYOUTS):
            raise ValueError(f"sft layouts {list(cfg.layouts)}: choose one or more of {list(LAYOUTS)}")
        if list(cfg.snapshots) != sorted(set(cfg.snapshots)) or any(
                s < 1 or (cfg.steps is not None and s >= cfg.steps) for s in cfg.snapshots):
            raise ValueError(f"sft snapshots {list(cfg.snapshots)}: increasing steps in [1, steps - 1] (the last "
                             "step is the model itself)")
        if cfg.shard not in parallel.SHARDING:
            raise ValueError(f"sft.shard {cfg.shard!r}: choose from {parallel.SHARDING}")
        return cfg


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr used by optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model, cfg: TrainConfig, total_steps: int):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps)

    def factor(step):  # a plain function: LambdaLR's state_dict then holds no code
        return lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def fingerprint(cfg: TrainConfig, seed: int, examples: list[Episode], world: int, init: str | Path | None) -> str:
    """What a checkpoint must match to be resumed (harness.run_identity): config, seed, world size, the initial
    model's weights file (`init`) and the examples' tokens."""
    # how the run is laid out is not what it computes: activation checkpointing and replicas (shard none) are
    # left out; fsdp stores its optimizer state by parameter name, so it is resumed by fsdp runs only. Snapshots
    # count when there are any: a run asked for other ones starts afresh, so that each one is written
    config = {k: v for k, v in asdict(cfg).items() if k != "activation_checkpointing" and (k, v) != ("shard", "none")
              and (k, v) != ("snapshots", ())}
    data = hashlib.sha256()
    for x in examples:
        inv = x.invocations[0]
        data.update(torch.tensor(inv.input_ids + [-1] + inv.output_ids + [-2], dtype=torch.int64).numpy().tobytes())
    return digest(run_identity(config, seed, {"init": init}, world=world, examples=data.hexdigest()))[:16]


@torch.no_grad()
def evaluate(model, examples: list[Episode], cfg: TrainConfig) -> dict:
    """Held-out target loss: mean NLL per target token over all `examples` (all ranks together). `model`:
    a replica or a sharded `parallel.Root` (its full parameters held while the ranks run their bins)."""
    rank, world, _ = dist_info()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    bins = bin_pack([example_len(x) for x in examples], cfg.seq_len, [x.task_id for x in examples])
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with parallel.gathered(model):  # sharded: the ranks may run different numbers of bins
        for b in bins[rank::world]:
            with parallel.autocast(device, cfg.dtype):
                s, n = parallel.call(model, lambda m, b=b: target_loss(m, [examples[i] for i in b], cfg.mode,
                                                                       cfg.seq_len, cfg.attention))
            total += torch.tensor([s.item(), n], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    nll, n = total.tolist()
    return {"target_loss": nll / n if n else float("nan"), "target_tokens": int(n), "examples": len(examples)}


def train(model, examples: list[Episode], heldout: list[Episode], cfg: TrainConfig, seed: int,
          checkpoint_dir: str | Path, log: Callable[[dict, int], None] | None = None,
          init: str | Path | None = None, stop_after: int | None = None, progress: bool = True,
          snapshot: Callable[[dict], None] | None = None) -> dict:
    """Train `model` in place on `examples`; resume from `checkpoint_dir` when it holds a checkpoint of this very
    run (same fingerprint; another run's is replaced). `log(metrics, step)` receives training curves and held-out
    evaluations (rank 0 only). `stop_after=k` returns right after the k-th optimizer step of this call (and its
    checkpoint), keeping nothing else: what a kill leaves behind (resume tests). Returns a summary (steps,
    train_seconds, final held-out evaluation, ...); the checkpoint stays until the caller has exported the model
    (harness.export, then harness.discard). With `cfg.shard` fsdp on several ranks `model` is sharded in place
    (its parameters become this rank's shards): harness.export gathers it. `snapshot({step, steps, fingerprint,
    train_seconds})` is called (on every rank: an export may be collective) right after each step of `cfg.snapshots`."""
    rank, world, _ = dist_info()
    lengths = [example_len(x) for x in examples]
    for i, n in enumerate(lengths):  # name the offending example before anything runs
        if n > cfg.seq_len:
            raise PackingLimitError(n, cfg.seq_len, [examples[i].task_id])
    plan = StepPlan(lengths, cfg.seq_len, cfg.grad_accum * world, seed, cfg.steps, cfg.epochs)
    torch.manual_seed(seed)
    if cfg.activation_checkpointing:  # before sharding: FSDP's hooks stay outside the recomputation
        parallel.checkpoint_activations(model)
    sharded = cfg.shard == "fsdp" and world > 1  # one rank: a shard is the whole model, the replica path
    net = parallel.shard(model, cfg.dtype) if sharded else model
    model.train()
    opt, sched = make_optimizer(model, cfg, plan.total_steps)  # on the shards when sharded
    fp = fingerprint(cfg, seed, examples, world, init)
    harness = Harness(Path(checkpoint_dir), {"fingerprint": fp}, plan.total_steps, cfg.checkpoint_every, "sft",
                      replace_other=True, parts=[Part("model", net, "optimizer", opt)],
                      schedulers={"scheduler": sched}, extra={"train_seconds": 0.0}, progress=progress)
    start = harness.resume(harness.find())
    step = _Step(net, model, examples, lengths, plan, cfg, opt, sched, harness.extra, rank, world, sharded)

    def run_step(i: int) -> str:
        m = step(i)
        done = i + 1
        if snapshot is not None and done in cfg.snapshots:
            snapshot({"step": done, "steps": plan.total_steps, "fingerprint": fp,
                      "train_seconds": harness.extra["train_seconds"]})
        if log and rank == 0 and (done % cfg.log_every == 0 or done == plan.total_steps):
            log(m, done)
        if heldout and cfg.eval_every and done % cfg.eval_every == 0 and done < plan.total_steps:
            ev = evaluate(net, heldout, cfg)
            if log and rank == 0:
                log({"heldout_target_loss": ev["target_loss"]}, done)
        return f"loss {m['train_loss']:.4f}, lr {m['lr']:.2e}"

    done = harness.loop(start, run_step, stop_after)
    if done < plan.total_steps:
        return {"completed": False, "step": done, "total_steps": plan.total_steps}
    final = evaluate(net, heldout, cfg) if heldout else None
    if final and log and rank == 0:
        log({"heldout_target_loss": final["target_loss"]}, plan.total_steps)
    return {"completed": True, "steps": plan.total_steps, "resumed_from": harness.extra.get("resumed_from"),
            "epochs": plan.epochs_seen, "train_seconds": harness.extra["train_seconds"], "fingerprint": fp,
            "train_examples": len(examples), "heldout_examples": len(heldout), "heldout": final,
            "last_train_loss": step.loss}


@dataclass
class _Step:
    """One optimizer step of SFT: every micro-batch of the step's bins, the loss summed over target tokens and
    divided by the step's count (all ranks), clipped, AdamW, the schedule. Returns the step's metrics."""
    net: torch.nn.Module  # what runs the forward: the model or its FSDP root
    model: torch.nn.Module
    examples: list[Episode]
    lengths: list[int]
    plan: StepPlan
    cfg: TrainConfig
    opt: torch.optim.Optimizer
    sched: object
    extra: dict  # the harness's: train_seconds accumulates here
    rank: int
    world: int
    sharded: bool
    loss: float | None = None

    def __post_init__(self):
        cfg = self.cfg
        self.device = next(self.model.parameters()).device
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.sharded:  # through the root's forward (its parameters gathered), FSDP sums gradients over ranks
            self.ddp, self.scale = None, 1
            self.step_loss = lambda batch: parallel.call(
                self.net, lambda m: target_loss(m, batch, cfg.mode, cfg.seq_len, cfg.attention)[0])
        else:
            self.ddp = TargetLoss(self.model, cfg.mode, cfg.seq_len, cfg.attention)
            if self.world > 1:
                self.ddp = torch.nn.parallel.DistributedDataParallel(self.ddp, device_ids=None)
            # DDP averages gradients over ranks: x world turns that into the sum
            self.step_loss, self.scale = self.ddp, self.world

    def __call__(self, step: int) -> dict:
        t0 = time.perf_counter()
        bins = self.plan.step(step)
        n_step = sum(target_len(self.examples[i]) for b in bins for i in b)  # all ranks' target tokens
        mine = bins[self.rank::self.world]
        self.opt.zero_grad(set_to_none=True)
        nll = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, b in enumerate(mine):
            last = self.world == 1 or self.sharded or k == len(mine) - 1
            with nullcontext() if last else self.ddp.no_sync():
                with parallel.autocast(self.device, self.cfg.dtype):
                    s = self.step_loss([self.examples[i] for i in b])
                (s * (self.scale / n_step)).backward()
            nll += s.detach().double()
        grad_norm = parallel.clip_grad_norm(self.params, self.cfg.clip)  # of the summed gradients
        if not math.isfinite(grad_norm):  # fail loudly rather than train on from NaN weights
            raise FloatingPointError(f"non-finite gradient norm at step {step + 1}")
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        if self.world > 1:
            dist.all_reduce(nll)
        dt = time.perf_counter() - t0
        self.extra["train_seconds"] += dt
        self.loss = nll.item() / n_step
        tokens = sum(self.lengths[i] for b in bins for i in b)
        return {"train_loss": self.loss, "lr": lr, "grad_norm": float(grad_norm), "target_tokens": n_step,
                "tokens_per_s": tokens / dt}
