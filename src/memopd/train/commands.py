"""`memopd train`: one PPO / MemOPD run (method, seed), tracked, its final policy exported as a model."""
from __future__ import annotations

from pathlib import Path

from memopd.inputs import UsageError, existing
from memopd.methods import METHODS, method as method_spec


def cmd_train(args, cfg):
    from memopd.harness import job
    from memopd.train.config import RunSections
    from memopd.train.loop import train_run

    run = RunSections.parse(cfg, args.method, args.seed).run  # a bad section named before anything runs
    if method_spec(args.method).needs_teacher and args.teacher is None:
        raise UsageError(f"method {args.method!r} needs --teacher")
    existing(args.student, args.teacher, args.tasks, args.index)
    out = Path(args.out_dir)
    with job(args.tracking, f"train-{args.method}-seed{args.seed}", cfg, "train", f"{args.method}_seed{args.seed}",
             args.seed, tags={"method": args.method, "benchmark": Path(args.tasks).stem}, threads=args.threads,
             dist_timeout_min=run.dist_timeout_min) as j:  # under torchrun: rank 0 tracks, exports and reports
        j.run.log_input(args.tasks, "train")
        hist = train_run(cfg, args.method, args.seed, args.student, args.teacher, args.tasks, args.index, out,
                         stop_after=args.stop_after, tracker=lambda m, step: j.run.log_metrics(
                             {k: v for k, v in m.items() if isinstance(v, (int, float))}, step))
        if j.rank == 0:
            j.run.log_artifact(out / "metrics.jsonl")
            finished = (out / "model").exists()
            if finished and args.export:  # the final policy, evaluated like any model
                _export(out / "model", Path(args.export))
            # the run's id beside the metrics and in the exported model: its evaluations become child runs
            j.run.write_ref(out, *([args.export] if finished and args.export else []))
            if finished:  # exported and recorded: the checkpoint goes at the very end of the job
                j.done(out / "checkpoint", run.keep_checkpoint)
    if j.rank == 0 and hist:
        last = hist[-1]
        print(f"{args.method} seed {args.seed}: step {last['step'] + 1} reward/f1 {last['reward/f1']:.3f} "
              f"rce {last.get('rce/max_abs_dlogp', float('nan')):.1e} step {last['time/step_s']:.1f}s")


def _export(model: Path, dest: Path) -> None:
    """The run's final policy copied to `dest` (a model directory); a destination that cannot take it is named."""
    import shutil

    try:
        shutil.copytree(model, dest, dirs_exist_ok=True)
    except (OSError, shutil.Error) as e:
        why = e.args[0] if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], str) else e
        raise UsageError(f"--export {dest}: cannot copy the final policy there ({type(e).__name__}: "
                         f"{str(why).splitlines()[0][:200]}); the run and its checkpoint are kept: rerun to export"
                         ) from None


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
