"""`memopd eval`, `memopd rce-rollouts` and `memopd bench decode`: the agent rolled out on benchmarks."""
from __future__ import annotations

import sys
from pathlib import Path

from memopd.inputs import UsageError, existing, section
from memopd.report.tables import write_csv, write_json


def cmd_eval(args, cfg):
    from memopd.agent.evaluate import agent_config, evaluate_benchmarks

    agent = agent_config(cfg)
    stems = [Path(b).stem for b in args.benchmark]
    if len(set(stems)) != len(stems):
        raise UsageError(f"two benchmarks write the same outputs: {stems}")
    existing(args.model, *args.benchmark)
    evaluate_benchmarks(cfg, agent, args.model, args.benchmark, args.index, args.out_dir, seed=args.seed,
                        limit=args.limit, tracking=args.tracking)


def cmd_rce_rollouts(args, cfg):
    from memopd.agent.evaluate import agent_config, rce_rollouts_step

    rc = section(cfg, "rce_rollouts", "max_new_tokens", "tasks", "dtype", "backends")
    agent = agent_config(cfg)
    existing(args.model, args.benchmark)
    report = rce_rollouts_step(cfg, agent, args.model, args.benchmark, args.index, seed=args.seed, limit=args.limit)
    write_json(args.out, report)
    tols = (f"{rc['dtype']} tolerances: max |d log p| <= {report['tolerance_dlogp']:g}, "
            f"max |d logit| <= {report['tolerance_dlogit']:g}")
    print(f"per backend: max |d log p| / max |d logit| vs each call run alone ({tols})")
    for rule, r in report["rules"].items():
        print(f"{rule:20s} " + "  ".join(f"{b} {x['max_abs_dlogp']:.2e}/{x['max_abs_dlogit']:.2e}"
                                         for b, x in r["backends"].items())
              + f"  behaviour {r['behaviour_vs_recomputed'].get('max_abs_dlogp', float('nan')):.2e}"
              + f"  {'PASS' if r['passed'] else 'FAIL'}")
    if not report["passed"] and args.strict:
        sys.exit(f"rollout RCE failed ({tols}); report in {args.out}")


def cmd_bench_decode(args, cfg):
    import torch
    from transformers import AutoTokenizer

    from memopd.agent.decode_bench import run
    from memopd.models import load_model

    existing(args.model)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or old_threads)
    try:
        model = load_model(args.model, dtype="float32")
        rows = run(model, AutoTokenizer.from_pretrained(args.model), batch=args.batch, tokens=args.tokens,
                   new_tokens=args.new_tokens, repeats=args.repeats, seed=args.seed)
    finally:  # a caller in the same process (the tests) keeps its threads
        torch.set_num_threads(old_threads)
    if args.out:
        write_csv(args.out, rows)
        print(f"wrote {args.out}")


def agent_args(sp):
    """The inputs of a step that rolls the agent out on one benchmark."""
    sp.add_argument("--model", required=True, help="model directory")
    sp.add_argument("--benchmark", required=True, help="benchmark parquet (results/benchmarks/*.parquet)")
    sp.add_argument("--index", required=True, help="retrieval index directory (memopd.retrieval)")
    sp.add_argument("--limit", type=int, help="first N tasks only")
    sp.add_argument("--out", required=True)
    return sp


def register(cli) -> None:
    sp = cli.add("eval", cmd_eval, "roll the agent out on benchmarks: per benchmark an aggregate JSON, a "
                 "per-episode CSV and the episodes, under --out-dir")
    sp.add_argument("--model", required=True, help="model directory")
    sp.add_argument("--benchmark", required=True, nargs="+", help="benchmark parquets (results/benchmarks/*.parquet)")
    sp.add_argument("--index", required=True, help="retrieval index directory (memopd.retrieval)")
    sp.add_argument("--limit", type=int, help="first N tasks of every benchmark (default: eval.max_tasks)")
    sp.add_argument("--out-dir", required=True, help="writes {benchmark}.json, .csv and .episodes.parquet here")
    sp.add_argument("--tracking", help="JSON of the `tracking` config section (uri, experiment); omit: no MLflow")
    sp = agent_args(cli.add("rce-rollouts", cmd_rce_rollouts, "RCE of real rollouts under every memory-rewrite rule"))
    sp.add_argument("--strict", action="store_true", help="exit non-zero when any rule or backend fails")

    sp = cli.add("bench decode", cmd_bench_decode, "HF generation: the backend's KV cache vs transformers' "
                 "DynamicCache (same outputs, time per call)")
    sp.add_argument("--model", default="results/models/base", help="a model directory (default: the base model)")
    sp.add_argument("--batch", type=int, default=32, help="rows generated together (rollout.batch_size)")
    sp.add_argument("--tokens", type=int, default=450, help="longest prompt; lengths spread over half to all of it")
    sp.add_argument("--new-tokens", type=int, default=48)
    sp.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats after one warm-up round")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sp.add_argument("--out", help="CSV file")
