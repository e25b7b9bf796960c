"""`memopd audit ...` (the alignment audits and ablation tables, config section `audit`), `memopd bench packing`
and `memopd bench opd-memory`."""
from __future__ import annotations

import json
import os
from pathlib import Path

from memopd.config import AuditRollout, AuditScoring, PackingAudit
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

    audit = AuditRollout.from_dict(section(cfg, "audit"))
    if not (args.rule or audit.rule):
        section(cfg, "agent", "rule")
    agent_config(cfg)
    existing(args.model, args.benchmark)
    _audit_threads(args)
    rollout_step(cfg, args.model, args.benchmark, args.index, args.out, args.seed, rule=args.rule, limit=args.limit)


def cmd_audit_alignment(args, cfg):
    from memopd.audit.steps import alignment_step

    scoring = AuditScoring.from_dict(cfg)
    existing(args.model, args.episodes)
    _audit_threads(args)
    print_table(alignment_step(scoring, args.model, args.episodes, args.out), args.out)


def cmd_audit_state_corruption(args, cfg):
    from memopd.audit.steps import state_corruption_step

    scoring = AuditScoring.from_dict(cfg)
    existing(args.model, args.episodes)
    _audit_threads(args)
    print_table(state_corruption_step(scoring, args.model, args.episodes, args.out), args.out)


def cmd_audit_teacher_divergence(args, cfg):
    from memopd.audit.steps import teacher_divergence_step

    scoring = AuditScoring.from_dict(cfg)
    existing(args.teacher, args.episodes)
    _audit_threads(args)
    print_table(teacher_divergence_step(scoring, args.teacher, args.episodes, args.out, args.figure), args.out)


def cmd_audit_action_domain(args, cfg):
    from memopd.audit.steps import action_domain_step

    existing(args.episodes)
    print_table(action_domain_step(cfg, args.episodes, args.out), args.out)


def cmd_audit_context_updates(args, cfg):
    from memopd.audit.steps import context_updates_step

    scoring = AuditScoring.from_dict(cfg)
    existing(args.model, *args.episodes)
    _audit_threads(args)
    print_table(context_updates_step(scoring, args.model, args.episodes, args.out), args.out)


def cmd_audit_packing(args, cfg):
    from memopd.audit.steps import packing_step

    backends = require(cfg, "backends")["backends"]
    pk = PackingAudit.from_dict(section(cfg, "packing"))  # a missing or unknown key, named before any model loads
    existing(args.model, args.episodes)
    _audit_threads(args)
    rows = packing_step(pk, backends, args.model, args.episodes, args.out, args.figure, seed=args.seed)
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


def cmd_audit_batch(args, cfg):
    """A trainer's batch against the exact call ledger of its rollout (memopd.audit.batch): JSON, a Markdown table
    beside it, a figure; logged to MLflow with --tracking. Exit 0 whatever it finds (a finding is a result)."""
    from memopd.audit.adapters import BatchFormatError, read_batch
    from memopd.audit.batch import audit, write_report
    from memopd.ledger import LedgerError, read_ledger
    from memopd.tracking import tracked

    existing(args.batch, args.ledger, *([args.model] if args.model else []))
    try:
        _, episodes = read_ledger(args.ledger)
        rows = read_batch(args.batch, args.format)
    except (LedgerError, BatchFormatError) as e:
        raise UsageError(str(e)) from None
    model = None
    if args.model:
        from memopd.models import load_model

        _audit_threads(args)
        model = load_model(args.model, dtype="float32", device="cpu").eval()
    report = audit(model, rows, episodes, numbers=model is not None)
    report.update(batch=args.batch, format=args.format, ledger=args.ledger, model=args.model)
    write_report(report, args.out)
    with tracked(args.tracking, f"audit-batch-{args.format}", {"batch": args.batch, "format": args.format,
                 "ledger": args.ledger, "model": args.model}, "audit", args.format, args.seed,
                 tags={"method": "audit", "benchmark": "batch"}) as run:
        run.log_metrics({f"batch/{k}": v for k, v in report["placement"]["counts"].items()}, 0)
        for kind, block in (report.get("numbers") or {}).items():
            run.log_metrics({f"batch/{kind}/{k}": v for k, v in block.items() if isinstance(v, (int, float))}, 0)
        for path in (args.out, Path(args.out).with_suffix(".md"), Path(args.out).with_suffix(".png")):
            if Path(path).exists():
                run.log_artifact(path)
    print(Path(args.out).with_suffix(".md").read_text())


def cmd_audit_representations(args, cfg):
    """Other trainers' layouts of the same episodes beside our packer: representation error and cost, one table."""
    from memopd.audit.representations import compare_layouts
    from memopd.ledger import from_episodes
    from memopd.models import load_model
    from memopd.outputs import write_table
    from memopd.records import load_episodes

    existing(args.model, *args.episodes)
    _audit_threads(args)
    model = load_model(args.model, dtype="float32", device="cpu")
    rows = []
    for path in args.episodes:
        rows += compare_layouts(model, from_episodes(load_episodes(path)), args.repeats, Path(path).stem)
    write_table(rows, args.out, f"The same episodes as other trainers lay them out, beside our packer (model "
                f"{args.model}, float32, {args.repeats} interleaved repeats): loss tokens off the state they were "
                "sampled in, the representation error of the batch's log-probs against the exact ones (p99, max "
                "|d log p|, false clips at 0.2 with identical weights), packed tokens and forward + backward seconds "
                "(median), each relative to ours with a 95% bootstrap interval over the repeats",
                notes=[f"Finding: {r['episodes']}: {r['layout']}: {r['off_state_tokens']} loss tokens off their state, "
                       f"max |d log p| {r['max_abs_dlogp']:.3g}, {r['tokens_vs_ours']:.2f}x ours' tokens, "
                       f"{r['time_vs_ours']:.2f}x [{r['time_vs_ours_lo']:.2f}, {r['time_vs_ours_hi']:.2f}] its time"
                       for r in rows])
    print_table(rows, args.out)


def cmd_certify(args, cfg):
    """A packer's certificate (memopd.audit.certify): JSON and one line; exit 1 when it fails."""
    import sys

    from memopd.audit.certify import certify, load_packer, random_ledger
    from memopd.ledger import LedgerError, read_ledger
    from memopd.models import load_model
    from memopd.outputs import write_json

    existing(args.model, *([args.ledger] if args.ledger else []))
    try:
        packer = load_packer(args.packer)
        ledgers = {"real": read_ledger(args.ledger)[1]} if args.ledger else {}
    except (ValueError, LedgerError) as e:
        raise UsageError(str(e)) from None
    _audit_threads(args)
    model = load_model(args.model, dtype="float32", device="cpu").eval()
    ledgers = {"random": random_ledger(Path(args.out).with_suffix(".random.jsonl"), model.config.vocab_size,
                                       args.seed), **ledgers}
    cert = {"packer": args.packer, "model": args.model, **certify(model, packer, ledgers)}
    write_json(args.out, cert)
    parts = [f"{name}: {v['episodes']} episodes, max |d log p| {v['max_abs_dlogp']:.2g}, "
             f"{'exact, once' if v['passed'] else 'NOT exact'}" for name, v in cert["ledgers"].items()]
    print(f"certify {args.packer}: {'PASS' if cert['passed'] else 'FAIL'} ({'; '.join(parts)}) -> {args.out}")
    if not cert["passed"]:
        sys.exit(1)


def register(cli) -> None:
    sp = cli.add("audit batch", cmd_audit_batch, "a trainer's batch (verl, SkyRL, TRL, tinker, MEM1 or rows) against "
                 "the exact call ledger of its rollout: numerical, sampler and representation error, train once")
    sp.add_argument("--batch", required=True, help="the batch, dumped as JSON of the framework's fields "
                    "(docs/audit-your-batch.md)")
    sp.add_argument("--format", required=True, choices=["verl", "skyrl", "trl", "tinker", "mem1", "rows"])
    sp.add_argument("--ledger", required=True, help="the exact call ledger of the rollout (docs/ledger.md)")
    sp.add_argument("--model", help="the model the batch trains (a model directory): the log-prob comparisons; "
                    "without it, only where each loss token lands")
    sp.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    sp.add_argument("--tracking", help="JSON of the `tracking` config section; omit: no MLflow")
    sp.add_argument("--out", required=True, help="JSON report (a Markdown table and a figure beside it)")
    sp = cli.add("audit representations", cmd_audit_representations, "other trainers' layouts of the same episodes "
                 "beside our packer: representation error, packed tokens, forward + backward time")
    sp.add_argument("--model", required=True, help="a model directory")
    sp.add_argument("--episodes", nargs="+", required=True, help="episodes (records parquet), e.g. "
                    "results/audit/episodes_summary_replacement.parquet")
    sp.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats")
    sp.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    sp.add_argument("--out", required=True, help="CSV (a Markdown table beside it)")
    sp = cli.add("certify", cmd_certify, "certify a packer (module:function, episodes -> rows): every sampled token "
                 "on its exact state, once; ratio 1 at lr = 0")
    sp.add_argument("--packer", required=True, help="module:function, e.g. memopd.audit.adapters:exact_packer")
    sp.add_argument("--model", required=True, help="a model directory to score with")
    sp.add_argument("--ledger", help="real episodes too (an exact call ledger, docs/ledger.md)")
    sp.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    sp.add_argument("--out", required=True, help="the certificate (JSON)")
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
