"""`memopd eval`, `memopd rce-rollouts` and `memopd bench eval`: the agent rolled out on benchmarks."""
from __future__ import annotations

import sys
from pathlib import Path

from memopd.inputs import UsageError, existing, section
from memopd.outputs import write_csv, write_json


def cmd_eval(args, cfg):
    from memopd.config import agent_config
    from memopd.evaluation.evaluate import evaluate_benchmarks

    agent = agent_config(cfg)
    stems = [Path(b).stem for b in args.benchmark]
    if len(set(stems)) != len(stems):
        raise UsageError(f"two benchmarks write the same outputs: {stems}")
    existing(args.model, *args.benchmark)
    evaluate_benchmarks(cfg, agent, args.model, args.benchmark, args.index, args.out_dir, seed=args.seed,
                        limit=args.limit, tracking=args.tracking)


def cmd_rce_rollouts(args, cfg):
    from memopd.config import RCERolloutsConfig, agent_config
    from memopd.evaluation.evaluate import rce_rollouts_step

    rc = RCERolloutsConfig.from_dict(section(cfg, "rce_rollouts"))
    agent = agent_config(cfg)
    existing(args.model, args.benchmark)
    report = rce_rollouts_step(cfg, rc, agent, args.model, args.benchmark, args.index, seed=args.seed,
                               limit=args.limit)
    write_json(args.out, report)
    tols = (f"{rc.dtype} tolerances: max |d log p| <= {report['tolerance_dlogp']:g}, "
            f"max |d logit| <= {report['tolerance_dlogit']:g}")
    print(f"per backend: max |d log p| / max |d logit| vs each call run alone ({tols})")
    for rule, r in report["rules"].items():
        print(f"{rule:20s} " + "  ".join(f"{b} {x['max_abs_dlogp']:.2e}/{x['max_abs_dlogit']:.2e}"
                                         for b, x in r["backends"].items())
              + f"  behaviour {r['behaviour_vs_recomputed'].get('max_abs_dlogp', float('nan')):.2e}"
              + f"  {'PASS' if r['passed'] else 'FAIL'}")
    if not report["passed"] and args.strict:
        sys.exit(f"rollout RCE failed ({tols}); report in {args.out}")


def cmd_bench_eval(args, cfg):
    import torch

    from memopd.evaluation import bench as eval_bench
    from memopd.generation.backends import PREFILLS, Sampling

    existing(args.model)
    bad = sorted(set(args.paths) - set(PREFILLS))
    if bad:
        raise UsageError(f"--paths: unknown prefill paths {bad} (known: {list(PREFILLS)})")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or old_threads)
    try:
        model, tok, work, label = _bench_eval_work(args)
        rows = eval_bench.run(model, tok, work, Sampling(temperature=0.0, max_new_tokens=args.new_tokens),
                              paths=tuple(args.paths), repeats=args.repeats, label=label)
    finally:  # a caller in the same process (the tests) keeps its threads
        torch.set_num_threads(old_threads)
    if args.out:
        write_csv(args.out, eval_bench.rows_as_dicts(rows))
        print(f"wrote {args.out}")


def _bench_eval_work(args):
    """(model, tokenizer, work, label): real episodes when the benchmark and the index exist, else synthetic prompts."""
    from transformers import AutoTokenizer

    from memopd.agent.protocol import load_tasks
    from memopd.config import AgentConfig
    from memopd.evaluation import bench as eval_bench
    from memopd.models import load_model
    from memopd.retrieval import load_retriever

    model, tok = load_model(args.model, dtype="float32"), AutoTokenizer.from_pretrained(args.model)
    if eval_bench.has_episodes(args.benchmark, args.index):
        tasks = load_tasks(args.benchmark, limit=args.limit)
        agent = AgentConfig(turns={"default": args.turns}, batch_size=args.batch, invalid_action=args.invalid_action)
        work = eval_bench.episodes_work(tasks, tok, load_retriever(args.index), agent, seed=args.seed)
        return model, tok, work, f"{Path(args.benchmark).stem}, {len(tasks)} episodes"
    print(f"no {args.benchmark} or no {args.index}: {args.batch} synthetic prompts instead of episodes", flush=True)
    prompts = eval_bench.synthetic_prompts(len(tok), args.batch, args.tokens, args.shared_tokens, seed=args.seed)
    return model, tok, eval_bench.prompts_work(prompts), f"{args.batch} synthetic prompts"


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

    sp = cli.add("bench eval", cmd_bench_eval, "HF generation: the prefill paths side by side on real evaluation "
                 "episodes (same greedy outputs, time per run)")
    sp.add_argument("--model", default="results/models/base", help="a model directory (default: the base model)")
    sp.add_argument("--benchmark", default="results/benchmarks/q2_test.parquet",
                    help="benchmark parquet; absent (or no --index): synthetic prompts")
    sp.add_argument("--index", default="results/retrieval/index", help="retrieval index directory")
    sp.add_argument("--limit", type=int, default=8, help="first N tasks of the benchmark")
    sp.add_argument("--turns", type=int, default=6, help="turn budget (calls) per episode")
    sp.add_argument("--invalid-action", choices=("end", "continue"), default="continue",
                    help="continue: an invalid call is told and the episode goes on (the zero-shot base model "
                    "answers in prose: its episodes would end after one call)")
    sp.add_argument("--batch", type=int, default=32, help="episodes (or synthetic prompts) generated together")
    sp.add_argument("--new-tokens", type=int, default=96, help="max new tokens per call (greedy)")
    sp.add_argument("--tokens", type=int, default=300, help="synthetic prompts: longest own part (half to all)")
    sp.add_argument("--shared-tokens", type=int, default=120, help="synthetic prompts: their common prefix")
    sp.add_argument("--paths", nargs="+", default=["padded", "shared"],
                    help="prefill paths (memopd.generation.backends.PREFILLS); the first is the baseline")
    sp.add_argument("--repeats", type=int, default=3, help="timed repeats, after one small untimed call per path")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sp.add_argument("--out", help="CSV file")
