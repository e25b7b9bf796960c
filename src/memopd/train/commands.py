"""`memopd train`: one PPO / MemOPD run (method, seed), tracked, its final policy exported as a model."""
from __future__ import annotations

from pathlib import Path

from memopd.inputs import UsageError, existing, section
from memopd.methods import METHODS, method as method_spec

TRAIN_KEYS = ("steps", "batch_tasks", "lr_actor", "lr_critic")  # what train_run reads of `train` without a default


def cmd_train(args, cfg):
    import shutil
    from contextlib import nullcontext

    from memopd.config import agent_config
    from memopd.dist import dist_info, rank_threads
    from memopd.harness import discard
    from memopd.tracking import NullRun, tracked
    from memopd.train.loop import train_run

    section(cfg, "train", *TRAIN_KEYS)
    agent_config(cfg)
    if method_spec(args.method).needs_teacher and args.teacher is None:
        raise UsageError(f"method {args.method!r} needs --teacher")
    existing(args.student, args.teacher, args.tasks, args.index)
    rank_threads(args.threads)
    rank, world, _ = dist_info()  # under torchrun: rank 0 tracks, exports and reports
    run_name = f"train-{args.method}-seed{args.seed}"
    with (tracked(args.tracking, run_name, cfg, stage="train", model=f"{args.method}_seed{args.seed}", seed=args.seed,
                  tags={"method": args.method, "benchmark": Path(args.tasks).stem})
          if rank == 0 else nullcontext(NullRun())) as run:
        run.log_input(args.tasks, "train")
        hist = train_run(cfg, args.method, args.seed, args.student, args.teacher, args.tasks, args.index,
                         args.out_dir, stop_after=args.stop_after,
                         tracker=lambda m, step: run.log_metrics(
                             {k: v for k, v in m.items() if isinstance(v, (int, float))}, step))
        if rank == 0:
            run.log_artifact(Path(args.out_dir) / "metrics.jsonl")
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank != 0:
        return
    if args.export and (Path(args.out_dir) / "model").exists():  # the final policy, evaluated like any model
        shutil.copytree(Path(args.out_dir) / "model", args.export, dirs_exist_ok=True)
    # the run's id beside the metrics and in the exported model: its evaluations become child runs
    run.write_ref(args.out_dir, *([args.export] if args.export and Path(args.export).exists() else []))
    if (Path(args.out_dir) / "model").exists():  # exported and recorded: only now is the checkpoint let go
        discard(Path(args.out_dir) / "checkpoint", cfg["train"].get("keep_checkpoint", False))
    if hist:
        last = hist[-1]
        print(f"{args.method} seed {args.seed}: step {last['step'] + 1} reward/f1 {last['reward/f1']:.3f} "
              f"rce {last.get('rce/max_abs_dlogp', float('nan')):.1e} step {last['time/step_s']:.1f}s")


def register(cli) -> None:
    sp = cli.add("train", cmd_train, "one PPO / MemOPD run (method, seed): rollouts, exact packed updates, checkpoints")
    sp.add_argument("--method", required=True, choices=list(METHODS))
    sp.add_argument("--student", required=True, help="SFT student directory (policy, critic and reference init)")
    sp.add_argument("--teacher", help="frozen teacher directory (the memopd methods; memopd_self: the SFT student itself; ppo uses none)")
    sp.add_argument("--tasks", required=True, help="training benchmark parquet")
    sp.add_argument("--index", required=True, help="retrieval index directory")
    sp.add_argument("--out-dir", required=True, help="run directory (metrics.jsonl, checkpoint/, model/)")
    sp.add_argument("--export", help="also copy the final policy here (a model directory)")
    sp.add_argument("--stop-after", type=int, help="stop after N steps of this invocation (resume tests)")
    sp.add_argument("--tracking", help="JSON of the `tracking` config section (uri, experiment); omit: no MLflow")
    sp.add_argument("--threads", type=int, default=0, help="the job's CPU threads, shared by the node's ranks "
                    "(0: torch's default)")
