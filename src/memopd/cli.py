"""`memopd` command line: one subcommand per pipeline step (the Snakemake rules call these).

Each step takes its configuration as `--cfg JSON` (the rule passes its section of the validated
Snakemake config) and records that configuration in what it writes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path


def _write_json(path: str | Path, obj) -> None:
    from memopd.report.tables import write_json

    write_json(path, obj)


def _write_csv(path: str | Path, rows: list[dict]) -> None:
    from memopd.report.tables import write_csv

    write_csv(path, rows)


def cmd_tokenizer(args, cfg):
    from memopd.data import corpus_texts
    from memopd.models import train_tokenizer

    tok = train_tokenizer(corpus_texts(args.data_dir), cfg["vocab_size"], args.out, cfg.get("min_frequency", 2))
    _write_json(Path(args.out) / "memopd_tokenizer.json", {"config": cfg, "data_dir": args.data_dir, "size": len(tok)})
    print(f"tokenizer: {len(tok)} tokens -> {args.out}")


def cmd_model_init(args, cfg):
    from memopd.models import init_model

    info = init_model(cfg, args.out, seed=args.seed, tokenizer_path=args.tokenizer, offline=not args.online)
    print(f"model: {info['architecture']} with {info['params']:,} parameters -> {args.out}")


def cmd_model_base(args, cfg):
    from memopd.models import packaged_model

    info = packaged_model(cfg, args.out)
    print(f"base model: {info['architecture']} with {info['params']:,} parameters from {cfg['package']}=="
          f"{cfg['version']} ({cfg['file']}, sha256 checked) -> {args.out}")


def _token_pool(tokenizer_dir: str, data_dir: str, n_texts: int = 200) -> list[int]:
    from memopd.synthetic import token_pool

    return token_pool(tokenizer_dir, data_dir, n_texts)


def cmd_rce(args, cfg):
    import torch

    from memopd.models import default_device, load_model
    from memopd.rce import rce_report, report_rows
    from memopd.synthetic import RULES, random_episode

    torch.manual_seed(args.seed)
    model = load_model(args.model, dtype=cfg["dtype"], device=args.device or default_device())
    pool = _token_pool(args.model, args.data_dir)
    rng = random.Random(args.seed)
    rules = cfg.get("rules", list(RULES))
    episodes = [
        random_episode(rng, pool, rules[i % len(rules)], cfg["calls"], cfg["prefix_tokens"],
                       tuple(cfg["observation_tokens"]), tuple(cfg["response_tokens"]), task_id=f"smoke{i}-{rules[i % len(rules)]}")
        for i in range(cfg["episodes"])
    ]
    report = rce_report(model, episodes, cfg["backends"], dtype=cfg["dtype"], tolerance=cfg.get("tolerance"))
    report["config"] = {**cfg, "seed": args.seed, "model": args.model}
    _write_json(args.out, report)
    _write_csv(Path(args.out).with_suffix(".csv"), report_rows(report))
    tols = (f"{report['dtype']} tolerances: max |d log p| <= {report['tolerance_dlogp']:g}, "
            f"max |d logit| <= {report['tolerance_dlogit']:g}")
    print(tols)
    for name, r in report["backends"].items():
        print(f"{name:14s} max|dlogp| {r['max_abs_dlogp']:.2e}  p99 {r['p99_abs_dlogp']:.2e}  "
              f"max|dlogit| {r['max_abs_dlogit']:.2e}  top1 {r['top1_agreement']:.3f}  "
              f"tokens {r['action_tokens']}  {'PASS' if r['passed'] else 'FAIL on ' + ', '.join(r['failed_on'])}")
    if not report["passed"] and args.strict:
        sys.exit(f"RCE failed ({tols}); report in {args.out}")


def cmd_bench_packing(args, cfg):
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    threads = args.threads or len(cpus)
    if threads > len(cpus):
        sys.exit(f"bench packing: --threads {threads} > the {len(cpus)} CPUs this process may use")
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
        _write_csv(args.out, rows)
        print(f"wrote {args.out}")
    if args.weights_out:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        Path(args.weights_out).write_text(json.dumps({"device": dev, "dtype": {**DEFAULTS, **(cfg or {})}["dtype"],
                                                      "threads": threads, **weights}, indent=1) + "\n")
        print(f"wrote {args.weights_out}")


def cmd_bench_decode(args, cfg):
    import torch
    from transformers import AutoTokenizer

    from memopd.agent.decode_bench import run
    from memopd.models import load_model

    old_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or old_threads)
    try:
        model = load_model(args.model, dtype="float32")
        rows = run(model, AutoTokenizer.from_pretrained(args.model), batch=args.batch, tokens=args.tokens,
                   new_tokens=args.new_tokens, repeats=args.repeats, seed=args.seed)
    finally:  # a caller in the same process (the tests) keeps its threads
        torch.set_num_threads(old_threads)
    if args.out:
        _write_csv(args.out, rows)
        print(f"wrote {args.out}")


def cmd_bench_opd_memory(args, cfg):
    from memopd.audit.opd_memory import run

    rows = run(n=args.tokens, vocab=args.vocab, hidden=args.hidden, chunk=args.chunk, device=args.device)
    if args.out:
        _write_csv(args.out, rows)


def cmd_bench_index(args, cfg):
    from memopd.retrieval.index_bench import run

    rows = run(sizes=args.sizes, dim=args.dim, shard=args.shard, queries=args.queries)
    if args.out:
        _write_csv(args.out, rows)
        print(f"wrote {args.out}")


def _data_errors_exit(fn):
    """Bad data or config -> one clear line on stderr, exit status 1, no traceback."""
    from memopd.data.loaders import DataConfigError, DataFormatError

    try:
        return fn()
    except (DataConfigError, DataFormatError) as e:
        sys.exit(f"error: {e}")


def cmd_benchmarks(args, cfg):
    from memopd.data.steps import build_benchmarks

    _data_errors_exit(lambda: build_benchmarks(cfg, args.data_dir, args.seed, args.out_dir, args.stats))


def cmd_retrieval_corpus(args, cfg):
    from memopd.retrieval.steps import corpus_step

    _data_errors_exit(lambda: corpus_step(cfg, args.data_dir, args.out))


def cmd_retrieval_index(args, cfg):
    from memopd.retrieval.steps import index_step

    index_step(cfg, args.corpus, args.out, online=args.online)


def cmd_retrieval_recall(args, cfg):
    from memopd.retrieval.steps import recall_step

    _data_errors_exit(lambda: recall_step(cfg, args.index, args.data_dir, args.seed, args.out, args.timing))


def cmd_retrieval_search(args, cfg):
    from memopd.retrieval.steps import search_step

    search_step(args.index, args.query, args.k)


def _agent_setup(args, cfg, **sampling):
    """Backend, tokenizer, model, retriever and agent config of the agent steps."""
    from memopd.agent.evaluate import load_retriever, make_backend
    from memopd.agent.rollout import AgentConfig

    import torch

    torch.manual_seed(args.seed)
    backend, tok, model = make_backend(cfg["rollout"], args.model, seed=args.seed, **sampling)
    agent = AgentConfig.from_dict(cfg["agent"], batch_size=cfg["rollout"]["batch_size"])
    return backend, tok, model, load_retriever(args.index), agent


def cmd_eval(args, cfg):
    """Every benchmark of one model in one process: the model, tokenizer and index load once (on the
    embedded default, loading and imports were ~10 s of each ~12 s per-benchmark job)."""
    import torch

    from memopd.agent.evaluate import episode_rows, eval_overrides, evaluate, load_tasks, make_sampling, per_benchmark
    from memopd.records import save_episodes
    from memopd.tracking import eval_metrics, run_ref, tracked

    ev = cfg.get("eval", {})
    stems = [Path(b).stem for b in args.benchmark]
    if len(set(stems)) != len(stems):
        raise SystemExit(f"eval: two benchmarks write the same outputs: {stems}")

    backend, tok, _, retriever, agent = _agent_setup(args, cfg, **eval_overrides(ev, stems[0]))
    out_dir = Path(args.out_dir)
    for path, bench in zip(args.benchmark, stems):
        torch.manual_seed(args.seed)  # as if each benchmark ran alone
        backend.sampling = make_sampling(cfg["rollout"], **eval_overrides(ev, bench))
        tasks = load_tasks(path, limit=args.limit or per_benchmark(ev.get("max_tasks"), bench))
        # a child of the run that trained the model (its id in the model directory), tagged with its method and seed
        with tracked(args.tracking, f"eval-{Path(args.model).name}-{bench}", cfg, stage="eval",
                     model=Path(args.model).name, seed=args.seed, tags={"benchmark": bench, "eval_seed": args.seed},
                     parent=run_ref(args.model)) as run:
            run.log_input(path, "eval")
            out, episodes = evaluate(tasks, backend, tok, retriever, agent, seed=args.seed)
            run.log_metrics(eval_metrics(out), 0)  # eval/f1, eval/em, eval/invalid_rate, ... in every eval run
        out.update(model=args.model, benchmark=path, backend=backend.name, config={**cfg, "seed": args.seed},
                   # the protocol used (eval overrides or the training rollout's): tables state the budget
                   max_new_tokens=backend.sampling.max_new_tokens, temperature=backend.sampling.temperature)
        out_path = out_dir / f"{bench}.json"
        _write_json(out_path, out)
        _write_csv(out_path.with_suffix(".csv"), episode_rows(episodes))
        save_episodes(out_path.with_suffix(".episodes.parquet"), episodes)
        print(f"{bench}: {len(episodes)} episodes: EM {out['em']:.3f} F1 {out['f1']:.3f} "
              f"calls/ep {out['calls_per_episode']:.2f} invalid {out['invalid_action_rate']:.3f} "
              f"peak {out['peak_context_tokens']:.0f} {out['throughput']['episodes_per_s']:.2f} ep/s "
              f"{out['throughput']['generated_tokens_per_s']:.0f} tok/s")


def cmd_rce_rollouts(args, cfg):
    from dataclasses import replace

    from memopd.agent.evaluate import load_tasks, rce_rollouts
    from memopd.agent.memory import RULES
    from memopd.models import default_device, load_model
    from memopd.rce import tolerance_fields, tolerances

    rc = cfg["rce_rollouts"]
    if rc.get("gpu_memory_utilization") is not None:  # the engine stays up while the model scores beside it
        cfg = {**cfg, "rollout": {**cfg["rollout"], "vllm": {**cfg["rollout"].get("vllm", {}),
                                                              "gpu_memory_utilization": rc["gpu_memory_utilization"]}}}
    backend, tok, model, retriever, agent = _agent_setup(args, cfg, max_new_tokens=rc["max_new_tokens"])
    tasks = load_tasks(args.benchmark, limit=args.limit or rc["tasks"])
    if model is None or str(model.dtype).split(".")[-1] != rc["dtype"]:
        # the packed and independent passes run under transformers in the audit's dtype
        model = load_model(args.model, dtype=rc["dtype"], device=default_device())
    agent = replace(agent, invalid_action=rc.get("invalid_action", agent.invalid_action))
    report = rce_rollouts(model, backend, tok, tasks, retriever, agent, rules=rc.get("rules") or RULES,
                          backends=rc["backends"], dtype=rc["dtype"], tolerance=rc.get("tolerance"), seed=args.seed)
    report["config"] = {**cfg, "seed": args.seed, "model": args.model, "benchmark": args.benchmark}
    report.update(tolerance_fields(tolerances(rc["dtype"], rc.get("tolerance"))))  # what every rule was gated on
    _write_json(args.out, report)
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


def cmd_train(args, cfg):
    import shutil
    from contextlib import nullcontext

    from memopd.sft.trainer import dist_info
    from memopd.tracking import NullRun, tracked
    from memopd.train.loop import train_run

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
    if hist:
        last = hist[-1]
        print(f"{args.method} seed {args.seed}: step {last['step'] + 1} reward/f1 {last['reward/f1']:.3f} "
              f"rce {last.get('rce/max_abs_dlogp', float('nan')):.1e} step {last['time/step_s']:.1f}s")


def cmd_report_results(args, cfg):
    """Tables 1-2 (multiobjective, wikirag) and the F1-vs-horizon figure; the matched control is its own
    command (report matched-control)."""
    from memopd.report.results import METRICS, budget_note, horizon_figure, load_scores, table_rows, vs_student_rows
    from memopd.report.tables import write_table

    methods, seeds = cfg["methods"], cfg["seeds"]
    horizons = cfg["horizons"]  # {benchmark: label}
    caption = (f"{{}}: mean +- std over seeds {seeds}, 95% bootstrap CI over seeds, change vs PPO in %, paired "
               f"per-seed difference vs PPO; student {cfg['student']}, teacher {cfg['teacher']}, "
               f"{cfg['steps']} steps x {cfg['batch_tasks']} tasks; EM/F1 = per-task mean over questions")
    q = {b: h for b, h in horizons.items() if h != "wikirag"}
    scores = load_scores(args.eval_dir, methods, seeds, list(horizons))
    multi = table_rows(scores, methods, q, METRICS["multiobjective"])
    write_table(multi, Path(args.out_dir) / "multiobjective.csv",
                f"{caption.format('Multi-objective (Q2 train)')}; {budget_note(scores, q)}")
    wiki = {b: h for b, h in horizons.items() if h == "wikirag"}
    if wiki:
        write_table(table_rows(scores, methods, wiki, METRICS["wikirag"]), Path(args.out_dir) / "wikirag.csv",
                    f"{caption.format('Wiki-RAG')}; {budget_note(scores, wiki)}")
    horizon_figure(multi, args.figure)
    rows = vs_student_rows(args.eval_dir, cfg["student"], methods, seeds, horizons)
    write_table(rows, Path(args.out_dir) / "vs_student.csv",
                f"Each method against the SFT student it started from ({cfg['student']}), per task: method (mean "
                f"over seeds {seeds}) - student, mean difference with a 95% paired bootstrap CI over tasks; "
                f"{cfg['steps']} steps x {cfg['batch_tasks']} tasks; {budget_note(scores, horizons)}",
                notes=[f"{r['method']} on {r['horizon']}, {r['metric']}: {r['mean']:.3f} vs the student's {r['student']:.3f}, "
                       f"difference {r['diff']:+.3f} (95% CI {r['ci_low']:+.3f} to {r['ci_high']:+.3f}, {r['tasks']} tasks): "
                       f"{r['noise']}" for r in rows])


def cmd_report_matched_control(args, cfg):
    """results/tables/matched_control.{csv,md}: its own runs (train.matched_control seeds) on its benchmark."""
    from memopd.report.results import matched_control_table

    _print_rows(matched_control_table(cfg, args.eval_dir, args.out), args.out)


def cmd_report_sft(args, cfg):
    """results/tables/sft_summary.csv: one row per model (student_init, student_sft, teacher_sft), and each model's
    F1 and EM against the reference model (--reference, the SFT student) task by task: the mean difference with a
    95% paired bootstrap interval over tasks (the per-task CSV beside each evaluation's JSON), and whether it
    excludes 0: is the teacher measurably better than the student, does SFT beat zero-shot."""
    from memopd.report.results import paired_over_tasks, task_scores
    from memopd.report.tables import write_table

    rows, scores = [], {}
    for name, heldout, ev, info in zip(args.names, args.heldout, args.eval, args.info):
        h, e, i = (json.loads(Path(p).read_text()) for p in (heldout, ev, info))
        # train_seconds: SFT only; pretrain_seconds: the LM pre-training stage before it (0: none)
        rows.append({"model": name, "params": h["params"], "train_seconds": i.get("sft", {}).get("train_seconds", 0.0),
                     "heldout_target_loss": h["heldout_target_loss"], "invalid_action_rate": e["invalid_action_rate"],
                     "em": e["em"], "f1": e["f1"], "pretrain_seconds": i.get("pretrain", {}).get("train_seconds", 0.0),
                     "calls_per_episode": e["calls_per_episode"], "answered_rate": e["answered_rate"],
                     "copy_f1": e.get("copy_f1", float("nan"))})
        scores[name] = {m: task_scores(Path(ev).with_suffix(".csv"), m) for m in ("f1", "em")}
    if args.reference not in scores:
        raise SystemExit(f"report sft: --reference {args.reference} is not among --names {args.names}")
    notes, ref = [], scores[args.reference]
    for row in rows:
        for m in ("f1", "em"):
            try:
                pt = paired_over_tasks(ref[m], scores[row["model"]][m])
            except ValueError as e:
                raise SystemExit(f"report sft: {row['model']} and {args.reference} were {e}") from None
            row.update({f"{m}_vs_ref": pt["diff"], f"{m}_vs_ref_ci_low": pt["ci_low"],
                        f"{m}_vs_ref_ci_high": pt["ci_high"]})
            if m == "f1" and row["model"] != args.reference:
                notes.append(f"Finding: {row['model']} - {args.reference}: F1 {pt['diff']:+.3f} "
                             f"[{pt['ci_low']:+.3f}, {pt['ci_high']:+.3f}] over {pt['tasks']} tasks, {pt['noise']}")
    bench, n = Path(args.eval[0]).stem, json.loads(Path(args.eval[0]).read_text())["episodes"]
    write_table(rows, args.out, f"SFT summary: held-out target loss on the held-out turn examples; EM/F1, "
                f"invalid-action rate, calls per episode, answered rate and the copy probe on {bench} "
                f"({n} tasks, greedy); *_vs_ref: the model minus {args.reference}, task by task, with a 95% paired "
                f"bootstrap interval over tasks", notes=notes)


def cmd_fetch(args, cfg):
    from memopd.data.hub import fetch_file

    fetch_file(cfg["repo"], cfg["file"], args.out, repo_type=cfg.get("repo_type", "dataset"),
               revision=cfg.get("revision"))
    print(f"fetched {cfg['repo']}/{cfg['file']} -> {args.out}")


def cmd_sft_trajectories(args, cfg):
    from memopd.agent.trajectories import trajectories_step

    for key in ("teacher", "agent", "rollout"):
        if key not in cfg:
            sys.exit(f"error: --cfg needs the config sections teacher, agent and rollout (missing {key!r})")
    try:
        s = trajectories_step(cfg, args.benchmark, args.index, args.tokenizer, args.out, args.stats, seed=args.seed,
                              limit=args.limit, server_log=args.server_log, shard=args.shard)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    kept = "  ".join(f"{k}: {v['trajectories']} ({v['turn_examples']} turns)" for k, v in s["filter_preview"].items())
    print(f"{s['trajectories_generated']} {s['teacher']} trajectories in {s['wall_s']:.1f}s: EM {s['em']:.3f} "
          f"F1 {s['f1']:.3f} calls/ep {s['calls_per_episode']:.2f} invalid {s['invalid_action_rate']:.3f}; "
          f"would keep {kept} -> {args.out}")


def _audit_threads(args):
    """Torch CPU threads of an audit step (the rule passes its Snakemake `threads`): on shared CPUs several
    OpenMP threads per process spin against the other jobs."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def cmd_audit_rollouts(args, cfg):
    from memopd.audit.steps import rollout_step

    _audit_threads(args)
    rollout_step(cfg, args.model, args.benchmark, args.index, args.out, args.seed, rule=args.rule, limit=args.limit)


def cmd_audit_alignment(args, cfg):
    from memopd.audit.steps import alignment_step

    _audit_threads(args)
    rows = alignment_step(cfg, args.model, args.episodes, args.out)
    _print_rows(rows, args.out)


def cmd_audit_state_corruption(args, cfg):
    from memopd.audit.steps import state_corruption_step

    _audit_threads(args)
    _print_rows(state_corruption_step(cfg, args.model, args.episodes, args.out), args.out)


def cmd_audit_teacher_divergence(args, cfg):
    from memopd.audit.steps import teacher_divergence_step

    _audit_threads(args)
    _print_rows(teacher_divergence_step(cfg, args.teacher, args.episodes, args.out, args.figure), args.out)


def cmd_audit_action_domain(args, cfg):
    from memopd.audit.steps import action_domain_step

    _print_rows(action_domain_step(cfg, args.episodes, args.out), args.out)


def cmd_audit_context_updates(args, cfg):
    from memopd.audit.steps import context_updates_step

    _audit_threads(args)
    _print_rows(context_updates_step(cfg, args.model, args.episodes, args.out), args.out)


def cmd_audit_packing(args, cfg):
    from memopd.audit.steps import packing_step

    _audit_threads(args)
    rows = packing_step(cfg, args.model, args.episodes, args.out, args.figure, seed=args.seed)
    print(f"{len(rows)} rows -> {args.out}")


def _print_rows(rows, out):
    print(Path(out).with_suffix(".md").read_text())
    print(f"{len(rows)} rows -> {out}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memopd", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name, fn, help, parent=sub):
        sp = parent.add_parser(name, help=help)
        sp.add_argument("--cfg", default="{}", help="JSON configuration of this step (a section of config.yaml)")
        sp.add_argument("--seed", type=int, default=0)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("tokenizer", cmd_tokenizer, "train the offline byte-level BPE tokenizer on data/")
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True)

    model = sub.add_parser("model", help="model checkpoints").add_subparsers(dest="model_command", required=True)
    sp = add("init", cmd_model_init, "create a model directory (tiny from config, or pretrained by name)", model)
    sp.add_argument("--tokenizer", help="tokenizer directory (tiny models)")
    sp.add_argument("--online", action="store_true", help="allow downloads from the hub (paper scale)")
    sp.add_argument("--out", required=True)
    sp = add("base", cmd_model_base, "de-quantise the packaged base model (--cfg: config models.base) once", model)
    sp.add_argument("--out", required=True)

    sp = add("rce", cmd_rce, "RCE smoke report: packed vs independent calls, every backend")
    sp.add_argument("--model", required=True)
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True, help="JSON report (a CSV is written beside it)")
    sp.add_argument("--strict", action="store_true", help="exit non-zero when any backend fails")
    sp.add_argument("--device", help="torch device of the model (default: the job's GPU if it has one, else cpu)")

    def agent_args(sp):
        sp.add_argument("--model", required=True, help="model directory")
        sp.add_argument("--benchmark", required=True, help="benchmark parquet (results/benchmarks/*.parquet)")
        sp.add_argument("--index", required=True, help="retrieval index directory (memopd.retrieval)")
        sp.add_argument("--limit", type=int, help="first N tasks only")
        sp.add_argument("--out", required=True)

    sp = add("eval", cmd_eval, "roll the agent out on benchmarks: per benchmark an aggregate JSON, a "
             "per-episode CSV and the episodes, under --out-dir")
    sp.add_argument("--model", required=True, help="model directory")
    sp.add_argument("--benchmark", required=True, nargs="+", help="benchmark parquets (results/benchmarks/*.parquet)")
    sp.add_argument("--index", required=True, help="retrieval index directory (memopd.retrieval)")
    sp.add_argument("--limit", type=int, help="first N tasks of every benchmark (default: eval.max_tasks)")
    sp.add_argument("--out-dir", required=True, help="writes {benchmark}.json, .csv and .episodes.parquet here")
    sp.add_argument("--tracking", help="JSON of the `tracking` config section (uri, experiment); omit: no MLflow")
    sp = add("rce-rollouts", cmd_rce_rollouts, "RCE of real rollouts under every memory-rewrite rule")
    agent_args(sp)
    sp.add_argument("--strict", action="store_true", help="exit non-zero when any rule or backend fails")

    sp = add("fetch", cmd_fetch, "download a data file from the hub (paper scale; --cfg {repo, file, ...})")
    sp.add_argument("--out", required=True)

    sp = add("train", cmd_train, "one PPO / MemOPD run (method, seed): rollouts, exact packed updates, checkpoints")
    sp.add_argument("--method", required=True, choices=["ppo", "memopd", "memopd_persistent"])
    sp.add_argument("--student", required=True, help="SFT student directory (policy, critic and reference init)")
    sp.add_argument("--teacher", help="frozen teacher directory (memopd methods; ppo uses none)")
    sp.add_argument("--tasks", required=True, help="training benchmark parquet")
    sp.add_argument("--index", required=True, help="retrieval index directory")
    sp.add_argument("--out-dir", required=True, help="run directory (metrics.jsonl, checkpoint/, model/)")
    sp.add_argument("--export", help="also copy the final policy here (a model directory)")
    sp.add_argument("--stop-after", type=int, help="stop after N steps of this invocation (resume tests)")
    sp.add_argument("--tracking", help="JSON of the `tracking` config section (uri, experiment); omit: no MLflow")

    report = sub.add_parser("report", help="tables and figures").add_subparsers(dest="report_command", required=True)
    sp = add("results", cmd_report_results, "Tables 1-2 (multi-objective, Wiki-RAG) from the evaluations", report)
    sp.add_argument("--eval-dir", default="results/eval")
    sp.add_argument("--out-dir", default="results/tables")
    sp.add_argument("--figure", default="results/figures/f1_vs_horizon.png")
    sp = add("matched-control", cmd_report_matched_control, "the matched control (ppo, memopd_persistent, memopd) "
             "on the seeds and benchmark of --cfg's matched_control", report)
    sp.add_argument("--eval-dir", default="results/eval", help="reads {eval-dir}/{method}_seed{seed}/{benchmark}.json")
    sp.add_argument("--out", default="results/tables/matched_control.csv", help="CSV (a Markdown table beside it)")
    sp = add("sft", cmd_report_sft, "the SFT summary table", report)
    sp.add_argument("--names", nargs="+", required=True)
    sp.add_argument("--heldout", nargs="+", required=True, help="results/sft/heldout_{name}.json, in --names order")
    sp.add_argument("--eval", nargs="+", required=True, help="results/eval/{name}/q2_test.json, in --names order")
    sp.add_argument("--info", nargs="+", required=True, help="results/models/{name}/memopd_model.json")
    sp.add_argument("--reference", default="student_sft", help="the model every other is compared with, task by task")
    sp.add_argument("--out", default="results/tables/sft_summary.csv")
    from memopd.report.curves import add_parser as add_curves  # `report curves`: the training-curves figure

    add_curves(add, report)

    sft = sub.add_parser("sft", help="SFT stage: trajectories, examples, training").add_subparsers(
        dest="sft_command", required=True)
    sp = add("trajectories", cmd_sft_trajectories, "teacher trajectories through the rollout loop: episodes + stats", sft)
    sp.add_argument("--benchmark", nargs="+", default=["results/benchmarks/q2_train.parquet"],
                    help="benchmark parquet file(s) (default: the Q2 train set)")
    sp.add_argument("--index", default="results/retrieval/index", help="retrieval index directory")
    sp.add_argument("--tokenizer", required=True, help="the student's tokenizer (or model) directory: defines the ids")
    sp.add_argument("--limit", type=int, help="first N tasks of each benchmark (overrides teacher.max_tasks)")
    sp.add_argument("--out", default="results/sft/trajectories.parquet")
    sp.add_argument("--stats", default="results/sft/trajectories_stats.json")
    sp.add_argument("--server-log", help="log of the vLLM server the llm teacher starts (default: beside --stats)")
    sp.add_argument("--shard", type=int, help="play only shard I of teacher.shards (a slice of the tasks, sampled as "
                    "in the whole run; merge with `memopd sft merge-trajectories`); default: every task")

    audit = sub.add_parser("audit", help="alignment audits and ablation tables (config section `audit`)")
    audit = audit.add_subparsers(dest="audit_command", required=True)
    sp = add("rollouts", cmd_audit_rollouts, "roll out the audit episodes once (parquet + provenance JSON); "
             "--cfg holds the agent, rollout and audit sections", audit)
    agent_args(sp)
    sp.add_argument("--rule", help="memory-rewrite rule (default: audit.rule, else agent.rule)")
    sp.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")

    def table_args(sp, model=True, figure=False, episodes_nargs=None):
        sp.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
        if model:
            sp.add_argument("--model", required=True, help="model directory that scores the episodes")
        sp.add_argument("--episodes", required=True, nargs=episodes_nargs,
                        help="episodes parquet (results/audit/episodes.parquet)")
        sp.add_argument("--out", required=True, help="CSV table (the Markdown table is written beside it)")
        if figure:
            sp.add_argument("--figure", required=True, help="PNG figure")
        return sp

    table_args(add("alignment", cmd_audit_alignment, "Table 3: persistent history, batched and packed vs "
                   "independent calls", audit))
    table_args(add("state-corruption", cmd_audit_state_corruption, "exact vs visibility / position / both "
                   "corruptions", audit))
    sp = add("teacher-divergence", cmd_audit_teacher_divergence, "the teacher on the flattened vs the exact "
             "state, by invocation", audit)
    sp.add_argument("--teacher", required=True, help="teacher model directory")
    table_args(sp, model=False, figure=True)
    table_args(add("action-domain", cmd_audit_action_domain, "exact action mask vs response and trajectory "
                   "masks", audit), model=False)
    table_args(add("context-updates", cmd_audit_context_updates, "RCE per memory-rewrite rule (one episodes file "
                   "per rule)", audit), episodes_nargs="+")
    table_args(add("packing-efficiency", cmd_audit_packing, "packing speedup vs token ratio, real and synthetic "
                   "episodes", audit), figure=True)

    bench = sub.add_parser("bench", help="benchmarks that print figures").add_subparsers(dest="bench_command", required=True)
    sp = add("packing", cmd_bench_packing, "packing benchmark: 9 configurations, every exact path, with RCE", bench)
    sp.add_argument("--out", help="CSV file")
    sp.add_argument("--repeats", type=int, default=10, help="interleaved timed repeats (the interval needs several)")
    sp.add_argument("--threads", type=int, default=0, help="torch threads, pinned to as many CPUs (0: every CPU "
                    "this process may use)")
    sp.add_argument("--weights-out", help="JSON of the memopd.cost weights fit to the timings")
    sp = add("decode", cmd_bench_decode, "HF generation: the backend's KV cache vs transformers' DynamicCache "
             "(same outputs, time per call)", bench)
    sp.add_argument("--model", default="results/models/base", help="a model directory (default: the base model)")
    sp.add_argument("--batch", type=int, default=32, help="rows generated together (rollout.batch_size)")
    sp.add_argument("--tokens", type=int, default=450, help="longest prompt; lengths spread over half to all of it")
    sp.add_argument("--new-tokens", type=int, default=48)
    sp.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats after one warm-up round")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sp.add_argument("--out", help="CSV file")
    sp = add("opd-memory", cmd_bench_opd_memory, "peak extra memory of the OPD term, chunked vs naive", bench)
    sp.add_argument("--tokens", type=int, default=8192)
    sp.add_argument("--vocab", type=int, default=151_936)
    sp.add_argument("--hidden", type=int, default=256)
    sp.add_argument("--chunk", type=int, default=128)
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--out", help="CSV file")
    sp = add("index", cmd_bench_index, "dense index build: peak RSS and time per corpus size (synthetic "
             "encoder, sharded build), and exact-search time", bench)
    sp.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000], help="passages per corpus")
    sp.add_argument("--dim", type=int, default=768)
    sp.add_argument("--shard", type=int, default=10_000, help="passages per shard (retrieval.dense.shard_passages)")
    sp.add_argument("--queries", type=int, default=64, help="queries of the timed exact searches")
    sp.add_argument("--out", help="CSV file")

    sp = add("benchmarks", cmd_benchmarks, "compose Q_n and Wiki-RAG tasks (config section `benchmarks`)")
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out-dir", default="results/benchmarks", help="one {benchmark}_{split}.parquet per task set")
    sp.add_argument("--stats", default="results/tables/benchmark_stats.csv")

    ret = sub.add_parser("retrieval", help="retrieval corpus, index, recall (config section `retrieval`)")
    ret = ret.add_subparsers(dest="retrieval_command", required=True)
    sp = add("corpus", cmd_retrieval_corpus, "de-duplicated passage corpus with stable ids (parquet)", ret)
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True)
    sp = add("index", cmd_retrieval_index, "build and save the index of the configured backend", ret)
    sp.add_argument("--corpus", required=True)
    sp.add_argument("--out", required=True, help="index directory")
    sp.add_argument("--online", action="store_true", help="allow downloading the dense encoder (paper scale)")
    sp = add("recall", cmd_retrieval_recall, "recall figures (NQ answer in top 5, HotpotQA support in top 10) and timing", ret)
    sp.add_argument("--index", required=True)
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True, help="CSV: dataset, metric, k, hits, total")
    sp.add_argument("--timing", required=True, help="CSV: build and query seconds")
    sp = add("search", cmd_retrieval_search, "print the top passages for queries, as the agent sees them", ret)
    sp.add_argument("--index", default="results/retrieval/index")
    sp.add_argument("-k", type=int, default=3)
    sp.add_argument("query", nargs="+")

    from memopd.plan import add_parser as add_plan  # `plan`: every job's memory and disk vs its resources

    add_plan(add, sub)
    from memopd.prefetch import add_parser as add_prefetch  # `prefetch`: the hub repositories, where the network is

    add_prefetch(add, sub)
    from memopd.sft.commands import register  # `sft ...`, `tracking init`, `bench sft`

    register(sub, add, bench, sft)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        cfg = json.loads(args.cfg)
    except json.JSONDecodeError as e:
        sys.exit(f"--cfg is not valid JSON: {e}")
    args.fn(args, cfg)


if __name__ == "__main__":
    main()
