"""`memopd audit ...` (the alignment audits and ablation tables, config section `audit`), `memopd bench packing`
and `memopd bench opd-memory`."""
from __future__ import annotations

import json
import os
from pathlib import Path

from memopd.evaluation.commands import agent_args
from memopd.inputs import UsageError, existing, require, section
from memopd.outputs import print_table, write_csv


def _audit_threads(args):
    """Torch CPU threads of an audit step (the rule passes its Snakemake `threads`): on shared CPUs several
    OpenMP threads per process spin against the other jobs."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def cmd_audit_rollouts(args, cfg):
    from memopd.config import agent_config
    from memopd.audit.steps import rollout_step

    audit = section(cfg, "audit", "episodes")
    if not (args.rule or audit.get("rule")):
        section(cfg, "agent", "rule")
    agent_config(cfg)
    existing(args.model, args.benchmark)
    _audit_threads(args)
    rollout_step(cfg, args.model, args.benchmark, args.index, args.out, args.seed, rule=args.rule, limit=args.limit)


def cmd_audit_alignment(args, cfg):
    from memopd.audit.steps import alignment_step

    require(cfg, "dtype", "clip", "backends")
    existing(args.model, args.episodes)
    _audit_threads(args)
    print_table(alignment_step(cfg, args.model, args.episodes, args.out), args.out)


def cmd_audit_state_corruption(args, cfg):
    from memopd.audit.steps import state_corruption_step

    require(cfg, "dtype", "clip")
    existing(args.model, args.episodes)
    _audit_threads(args)
    print_table(state_corruption_step(cfg, args.model, args.episodes, args.out), args.out)


def cmd_audit_teacher_divergence(args, cfg):
    from memopd.audit.steps import teacher_divergence_step

    require(cfg, "dtype")
    existing(args.teacher, args.episodes)
    _audit_threads(args)
    print_table(teacher_divergence_step(cfg, args.teacher, args.episodes, args.out, args.figure), args.out)


def cmd_audit_action_domain(args, cfg):
    from memopd.audit.steps import action_domain_step

    existing(args.episodes)
    print_table(action_domain_step(cfg, args.episodes, args.out), args.out)


def cmd_audit_context_updates(args, cfg):
    from memopd.audit.steps import context_updates_step

    require(cfg, "dtype", "backends")
    existing(args.model, *args.episodes)
    _audit_threads(args)
    print_table(context_updates_step(cfg, args.model, args.episodes, args.out), args.out)


def cmd_audit_packing(args, cfg):
    from memopd.audit.steps import packing_step

    require(cfg, "backends")
    section(cfg, "packing", "synthetic", "repeats", "real")
    existing(args.model, args.episodes)
    _audit_threads(args)
    rows = packing_step(cfg, args.model, args.episodes, args.out, args.figure, seed=args.seed)
    print(f"{len(rows)} rows -> {args.out}")


def cmd_bench_packing(args, cfg):
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    threads = args.threads or len(cpus)
    if threads > len(cpus):
        raise UsageError(f"--threads {threads} > the {len(cpus)} CPUs this process may use")
    old_threads = torch.get_num_threads()
    os.sched_setaffinity(0, cpus[:threads])  # pinned: one thread per core, no migration between repeats
    torch.set_num_threads(threads)
    try:
        _bench_packing(args, cfg, threads, cpus[:threads])
    finally:  # a caller in the same process (the tests) gets its CPUs back
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(old_threads)


def _bench_packing(args, cfg, threads, pinned):
    import torch

    from memopd.audit.packing_bench import DEFAULTS, calibrate, run_sweep, summarize

    print(f"bench packing: {threads} torch thread(s) pinned to CPUs {pinned}, {args.repeats} interleaved repeats")
    rows = run_sweep(cfg, seed=args.seed, repeats=args.repeats)
    print("\n".join(summarize(rows)))
    weights = calibrate(rows)
    print("memopd.cost weights fit to these timings (seconds per FLOP / per layer invocation):")
    for pass_name, w in weights.items():
        print(f"  {pass_name}: " + ", ".join(f"{k} {v:.3e}" for k, v in w.items()))
    if args.out:
        write_csv(args.out, rows)
        print(f"wrote {args.out}")
    if args.weights_out:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        Path(args.weights_out).write_text(json.dumps({"device": dev, "dtype": {**DEFAULTS, **(cfg or {})}["dtype"],
                                                      "threads": threads, **weights}, indent=1) + "\n")
        print(f"wrote {args.weights_out}")


def cmd_bench_opd_memory(args, cfg):
    from memopd.audit.opd_memory import run

    rows = run(n=args.tokens, vocab=args.vocab, hidden=args.hidden, chunk=args.chunk, device=args.device)
    if args.out:
        write_csv(args.out, rows)


def table_args(sp, model=True, figure=False, episodes_nargs=None):
    """The inputs and outputs of an audit table."""
    sp.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    if model:
        sp.add_argument("--model", required=True, help="model directory that scores the episodes")
    sp.add_argument("--episodes", required=True, nargs=episodes_nargs,
                    help="episodes parquet (results/audit/episodes.parquet)")
    sp.add_argument("--out", required=True, help="CSV table (the Markdown table is written beside it)")
    if figure:
        sp.add_argument("--figure", required=True, help="PNG figure")
    return sp


def register(cli) -> None:
    sp = agent_args(cli.add("audit rollouts", cmd_audit_rollouts, "roll out the audit episodes once (parquet + "
                            "provenance JSON); --cfg holds the agent, rollout and audit sections"))
    sp.add_argument("--rule", help="memory-rewrite rule (default: audit.rule, else agent.rule)")
    sp.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    table_args(cli.add("audit alignment", cmd_audit_alignment, "Table 3: persistent history, batched and packed vs "
                       "independent calls"))
    table_args(cli.add("audit state-corruption", cmd_audit_state_corruption, "exact vs visibility / position / both "
                       "corruptions"))
    sp = cli.add("audit teacher-divergence", cmd_audit_teacher_divergence, "the teacher on the flattened vs the exact "
                 "state, by invocation")
    sp.add_argument("--teacher", required=True, help="teacher model directory")
    table_args(sp, model=False, figure=True)
    table_args(cli.add("audit action-domain", cmd_audit_action_domain, "exact action mask vs response and trajectory "
                       "masks"), model=False)
    table_args(cli.add("audit context-updates", cmd_audit_context_updates, "RCE per memory-rewrite rule (one episodes "
                       "file per rule)"), episodes_nargs="+")
    table_args(cli.add("audit packing-efficiency", cmd_audit_packing, "packing speedup vs token ratio, real and "
                       "synthetic episodes"), figure=True)

    sp = cli.add("bench packing", cmd_bench_packing, "packing benchmark: 9 configurations, every exact path, with RCE")
    sp.add_argument("--out", help="CSV file")
    sp.add_argument("--repeats", type=int, default=10, help="interleaved timed repeats (the interval needs several)")
    sp.add_argument("--threads", type=int, default=0, help="torch threads, pinned to as many CPUs (0: every CPU "
                    "this process may use)")
    sp.add_argument("--weights-out", help="JSON of the memopd.cost weights fit to the timings")
    sp = cli.add("bench opd-memory", cmd_bench_opd_memory, "peak extra memory of the OPD term, chunked vs naive")
    sp.add_argument("--tokens", type=int, default=8192)
    sp.add_argument("--vocab", type=int, default=151_936)
    sp.add_argument("--hidden", type=int, default=256)
    sp.add_argument("--chunk", type=int, default=128)
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--out", help="CSV file")
