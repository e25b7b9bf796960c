"""`memopd sft ...` and `memopd bench sft`: teacher trajectories, turn examples, pre-training data, SFT and its
held-out evaluation, and the packed-vs-padded benchmark.

Tracked commands take `--tracking JSON` (the `tracking` config section: uri, experiment); without it
they record nothing in MLflow and say so. MLFLOW_TRACKING_URI in the environment overrides the uri.
"""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from memopd.inputs import ConfigError, UsageError, existing, require, section
from memopd.outputs import write_csv, write_json


@contextmanager
def _tracked(args, run_name: str, config: dict, stage: str, model: str, enabled: bool = True, tags: dict | None = None,
             parent: dict | None = None):
    from memopd.tracking import NullRun, tracked

    if not enabled:
        yield NullRun()
        return
    with tracked(args.tracking, run_name, config, stage, model, args.seed, tags=tags, parent=parent) as run:
        yield run


def train_config(cfg: dict, role: str | None, stage: str = "sft"):
    """The TrainConfig of a role from the `sft` section; a ConfigError says what the section lacks."""
    from memopd.sft.trainer import TrainConfig, stage_section

    try:
        return TrainConfig.from_section(stage_section(cfg, stage), role)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section 'sft': {e}") from None


def example_layouts(cfg: dict) -> tuple[str, ...]:
    """Every state some role trains on (sft.<role>.layouts), in sft.data.LAYOUTS order: what `sft examples` writes."""
    from memopd.sft.data import LAYOUTS
    from memopd.sft.trainer import ROLES

    wanted = {k for r in ROLES if r in cfg for k in train_config(cfg, r).layouts}
    return tuple(k for k in LAYOUTS if k in wanted) or ("exact",)


def cmd_sft_trajectories(args, cfg):
    from memopd.teachers.trajectories import trajectories_step

    section(cfg, "teacher", "kind")
    section(cfg, "agent")
    section(cfg, "rollout")
    existing(args.tokenizer, args.index)  # a missing benchmark: trajectories_step names it, with how to build it
    try:
        s = trajectories_step(cfg, args.benchmark, args.index, args.tokenizer, args.out, args.stats, seed=args.seed,
                              limit=args.limit, server_log=args.server_log, shard=args.shard)
    except ValueError as e:  # a teacher kind or shard that does not exist
        raise UsageError(str(e)) from None
    kept = "  ".join(f"{k}: {v['trajectories']} ({v['turn_examples']} turns)" for k, v in s["filter_preview"].items())
    print(f"{s['trajectories_generated']} {s['teacher']} trajectories in {s['wall_s']:.1f}s: EM {s['em']:.3f} "
          f"F1 {s['f1']:.3f} calls/ep {s['calls_per_episode']:.2f} invalid {s['invalid_action_rate']:.3f}; "
          f"would keep {kept} -> {args.out}")


def cmd_sft_examples(args, cfg):
    from memopd.records import load_episodes, save_episodes
    from memopd.sft.data import turn_examples

    require(cfg, "min_reward")
    existing(args.episodes)
    examples, stats = turn_examples(load_episodes(args.episodes), cfg["min_reward"], example_layouts(cfg))
    stats = {"teacher": args.teacher, **stats}
    save_episodes(args.out, examples)
    write_json(args.stats, {**stats, "episodes": args.episodes, "config": cfg})
    if args.table:
        write_csv(args.table, [{k: stats[k] for k in ("teacher", "trajectories_generated", "trajectories_kept",
                                                      "turn_examples")}])
    with _tracked(args, "sft_examples", {"sft": cfg, "episodes": args.episodes}, "sft_examples", args.teacher,
                  tags={"method": "sft", "benchmark": Path(args.episodes).stem}) as run:
        run.log_input(args.episodes, "source", name="sft/" + Path(args.episodes).stem)
        run.log_metrics({k: v for k, v in stats.items() if isinstance(v, (int, float))}, 0)
        run.log_dict(stats, "stats.json")
    print(f"{stats['trajectories_kept']}/{stats['trajectories_generated']} trajectories kept -> "
          f"{stats['turn_examples']} turn examples ({stats['duplicates_dropped']} duplicates dropped) -> {args.out}")


def cmd_sft_merge_trajectories(args, cfg):
    from memopd.teachers.trajectories import merge_step

    existing(*args.shards, *args.shard_stats)
    try:
        s = merge_step(args.shards, args.shard_stats, args.out, args.stats)
    except ValueError as e:  # shards of another run, or out of order
        raise UsageError(str(e)) from None
    print(f"{len(args.shards)} shards -> {s['trajectories_generated']} {s['teacher']} trajectories "
          f"({s['turn_examples']} calls): EM {s['em']:.3f} F1 {s['f1']:.3f} -> {args.out}")


def cmd_sft_lm_data(args, cfg):
    """Pre-training data from the corpus passages as the agent reads them (`(Title: t) text`, the layout
    of its <information> blocks), tokenised once: with `sft.pretrain.lm_text` every passage as plain
    language-model text (cut into chunks of at most sft.seq_len tokens, none dropped), plus the copy
    curriculum of `sft.pretrain.copy`."""
    from memopd.models import load_tokenizer
    from memopd.records import save_episodes
    from memopd.retrieval.base import passage_text
    from memopd.retrieval.corpus import read_corpus
    from memopd.sft.data import PRETRAIN_DEFAULTS, copy_examples, lm_examples

    require(cfg, "seq_len")
    existing(args.corpus, args.tokenizer)
    pre = cfg.get("pretrain") or {}
    corpus = read_corpus(args.corpus)
    tok = load_tokenizer(args.tokenizer)
    texts = [passage_text(t, x) for t, x in zip(corpus["title"], corpus["text"])]
    ids = [x + [tok.eos_token_id] for x in tok(texts, add_special_tokens=False)["input_ids"]]
    examples = lm_examples(ids, cfg["seq_len"], corpus["id"]) if pre.get("lm_text", PRETRAIN_DEFAULTS["lm_text"]) else []
    copy = {**PRETRAIN_DEFAULTS["copy"], **(pre.get("copy") or {})}
    copies = copy_examples([x[:-1] for x in ids], copy["per_text"], tuple(copy["span"]),
                           tok("\n", add_special_tokens=False)["input_ids"], tok.eos_token_id, args.seed,
                           copy["context"])
    save_episodes(args.out, examples + copies)
    stats = {"passages": len(texts), "lm_examples": len(examples), "copy_examples": len(copies),
             "lm_target_tokens": sum(len(x.invocations[0].output_ids) for x in examples),
             "copy_target_tokens": sum(len(x.invocations[0].output_ids) for x in copies),
             "corpus": args.corpus, "tokenizer": args.tokenizer, "seed": args.seed, "config": cfg}
    write_json(args.stats, stats)
    print(f"{len(texts)} passages -> {len(examples)} LM examples ({stats['lm_target_tokens']} target tokens) + "
          f"{len(copies)} copy examples -> {args.out}")


def stage_repeats(tokenizer_dir: str, tcfg, seed: int) -> list:
    """The stage's `sft.repeats` examples over the tokenizer's ordinary tokens (no added or special token)."""
    from memopd.models import load_tokenizer, ordinary_token_ids
    from memopd.sft.data import repeat_examples

    if not tcfg.repeats:
        return []
    tok = load_tokenizer(tokenizer_dir)
    sep = tok("\n", add_special_tokens=False)["input_ids"]
    return repeat_examples(ordinary_token_ids(tok), tcfg.repeats, tcfg.repeat_length, sep, tok.eos_token_id, seed)


def snapshot_dir(out: str | Path, step: int) -> Path:
    """Where `sft train` exports the weights after step `step` of `sft.<role>.snapshots` (published to a model
    directory of its own by `sft snapshot`)."""
    return Path(out) / "snapshots" / f"step_{step}"


def snapshot_writer(model, out: Path, tokenizer, base: dict, stage: str, record: dict, rank: int):
    """The trainer's `snapshot` callback: the weights after a step, written whole or not at all, with the model
    record of the run up to that step (`stage`: its steps, seconds and fingerprint; `snapshot`: which step)."""
    from memopd.checkpoint import publish_dir
    from memopd.harness import export

    def write(step: dict) -> None:
        d = snapshot_dir(out, step["step"])
        tmp = d.with_name(d.name + ".tmp")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        export(model, tmp, tokenizer)
        if rank == 0:
            own = {"steps": step["step"], "train_seconds": step["train_seconds"], "fingerprint": step["fingerprint"]}
            write_json(tmp / "memopd_model.json", {**base, stage: {**record, **own}, "snapshot": step})
            publish_dir(tmp, d)

    return write


def cmd_sft_train(args, cfg):
    from memopd.harness import export, job
    from memopd.models import load_model, load_tokenizer
    from memopd.records import load_episodes
    from memopd.sft.data import of_layouts, split_heldout
    from memopd.sft.trainer import train

    tcfg = train_config(cfg, args.role, args.stage)
    existing(args.examples, args.init)
    name = f"{args.role}_{'lm' if args.stage == 'pretrain' else 'sft'}"
    seed = args.seed if tcfg.seed is None else tcfg.seed  # the held-out split keeps args.seed
    run_cfg = {"sft": cfg, "role": args.role, "stage": args.stage, "resolved": asdict(tcfg), "seed": args.seed,
               "examples": args.examples, "init": args.init}
    tags = {"method": "pretrain" if args.stage == "pretrain" else "sft", "role": args.role,
            "benchmark": "sft/" + Path(args.examples).stem}
    out = Path(args.out)
    with job(args.tracking, f"{args.stage}_{args.role}", run_cfg, f"{args.stage}_train", name, args.seed, tags=tags,
             threads=args.threads, dist_timeout_min=tcfg.dist_timeout_min) as j:
        train_ex, heldout = split_heldout(load_episodes(args.examples), tcfg.eval_fraction, args.seed)
        # the role's states (sft.<role>.layouts); the held-out loss is always the exact states' (comparable)
        train_ex, heldout = of_layouts(train_ex, tcfg.layouts), of_layouts(heldout, ("exact",))
        train_ex += stage_repeats(args.init, tcfg, seed)  # training only: the held-out loss stays the agent's
        model = load_model(args.init, dtype="float32", device=str(j.device))  # fp32 master weights
        info_path = Path(args.init) / "memopd_model.json"
        base = {**(json.loads(info_path.read_text()) if info_path.exists() else {}),
                "params": sum(p.numel() for p in model.parameters()), "init": args.init}
        record = {"role": args.role, "config": asdict(tcfg), "seed": seed, "examples": args.examples}
        snapshot = snapshot_writer(model, out, load_tokenizer(args.init), base, args.stage, record, j.rank)
        j.run.log_params({"world_size": j.world, "device": str(j.device)})
        j.run.log_input(args.examples, "train", name="sft/" + Path(args.examples).stem)
        summary = train(model, train_ex, heldout, tcfg, seed, out / "checkpoint", log=j.run.log_metrics,
                        init=Path(args.init).resolve() / "model.safetensors", snapshot=snapshot)
        export(model, out, load_tokenizer(args.init))  # sft.shard fsdp: gathered from the shards (collective)
        if j.rank == 0:
            write_json(out / "memopd_model.json", {**base, args.stage: {**record, **summary}})
            j.run.log_dict(summary, "summary.json")
            j.run.log_metrics({"train_seconds": summary["train_seconds"]}, summary["steps"])
            j.run.write_ref(out)  # the model's evaluations (sft eval, eval) become child runs of this one
        j.done(out / "checkpoint")  # let go last, once the run's records and the process group are finished
    if j.rank == 0:
        h = summary["heldout"]
        heldout = f"held-out target loss {h['target_loss']:.4f}" if h else "no held-out examples"
        print(f"{args.stage} {args.role}: {summary['steps']} steps ({summary['epochs']:.2f} epochs) in "
              f"{summary['train_seconds']:.0f} s; {heldout} -> {out}")


def cmd_sft_snapshot(args, cfg):
    """Publish a snapshot of a finished SFT run as a model directory of its own, after checking that it is this
    run's (the same fingerprint as the final model's): one written by an earlier run of other settings is refused."""
    from memopd.checkpoint import publish_dir

    existing(args.model)
    final = json.loads((Path(args.model) / "memopd_model.json").read_text())
    src = snapshot_dir(args.model, args.step)
    if not (src / "memopd_model.json").exists():
        raise UsageError(f"{args.model}: no snapshot after step {args.step} (sft.<role>.snapshots lists the steps "
                         f"a run exports; {src} is missing)")
    snap = json.loads((src / "memopd_model.json").read_text())
    run = final.get("sft") or final.get("pretrain") or {}
    if snap["snapshot"]["fingerprint"] != run.get("fingerprint"):
        raise UsageError(f"{src} is a snapshot of another run (fingerprint {snap['snapshot']['fingerprint']}, the "
                         f"model's {run.get('fingerprint')}): retrain {args.model}")
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    publish_dir(tmp, out)
    print(f"{args.model} after step {args.step} of {run.get('steps')} -> {out}")


def cmd_sft_eval(args, cfg):
    from memopd.dist import rank_threads, setup_distributed
    from memopd.models import load_model
    from memopd.records import load_episodes
    from memopd.sft.data import of_layouts, split_heldout
    from memopd.sft.trainer import evaluate
    from memopd.tracking import run_ref

    tcfg = train_config(cfg, args.role)
    existing(args.examples, args.model)
    rank_threads(args.threads)
    device = setup_distributed(tcfg.dist_timeout_min)
    _, heldout = split_heldout(load_episodes(args.examples), tcfg.eval_fraction, args.seed)
    heldout = of_layouts(heldout, ("exact",))  # the exact states, whatever layouts the roles trained on
    if not heldout:
        raise UsageError("no held-out examples (sft.eval_fraction is 0 or too small for the data)")
    model = load_model(args.model, dtype="float32", device=str(device))
    run_cfg = {"sft": cfg, "role": args.role, "seed": args.seed, "examples": args.examples, "model": args.model}
    with _tracked(args, f"sft_eval_{args.name}", run_cfg, "sft_eval", args.name, parent=run_ref(args.model),
                  tags={"role": args.role, "benchmark": "sft/" + Path(args.examples).stem}) as run:
        run.log_input(args.examples, "eval", name="sft/" + Path(args.examples).stem)
        ev = evaluate(model, heldout, tcfg)
        result = {"model": args.name, "params": sum(p.numel() for p in model.parameters()),
                  "heldout_target_loss": ev["target_loss"], "heldout_target_tokens": ev["target_tokens"],
                  "heldout_examples": ev["examples"], "config": run_cfg}
        run.log_metrics({"eval/heldout_target_loss": ev["target_loss"]}, 0)  # as the SFT run's heldout_target_loss curve
        run.log_dict(result, "eval.json")
    write_json(args.out, result)
    print(f"{args.name}: held-out target loss {ev['target_loss']:.4f} over {ev['target_tokens']} tokens -> {args.out}")


def cmd_bench_sft(args, cfg):
    import torch

    from memopd.dist import rank_threads
    from memopd.models import load_model
    from memopd.sft.bench import SHAPES, bench_sft, synthetic_examples
    from memopd.synthetic import token_pool

    tcfg = train_config(cfg, "student")
    existing(args.model, args.data_dir)
    rank_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, dtype="float32", device=device)
    examples = synthetic_examples(token_pool(args.model, args.data_dir), args.examples, args.seed)
    run_cfg = {"sft": cfg, "seed": args.seed, "model": args.model, "examples": args.examples, "shapes": SHAPES,
               "max_bins": args.max_bins, "device": device}
    with _tracked(args, "bench_sft", run_cfg, "bench_sft", Path(args.model).name,
                  tags={"method": "bench", "benchmark": "synthetic"}) as run:
        rows = bench_sft(model, examples, tcfg.seq_len, tcfg.lr, args.seed, max_bins=args.max_bins)
        for r in rows:
            run.log_metrics({f"{r['path']}_tokens_per_s".replace("/", "_"): r["tokens_per_s"]}, 0)
            print(f"{r['path']:17s} {r['tokens_per_s']:8.0f} tokens/s  x{r['speedup_over_padded']:.2f} of padded  "
                  f"padding {100 * r['padding_fraction']:4.1f}%  {r['batches']} batches, {r['examples']} examples, "
                  f"{r['seconds']:.1f} s  first loss {r['first_loss']:.5f}")
        print(f"(seq_len {tcfg.seq_len}, {len(examples)} synthetic turn examples, {device}, {rows[0]['threads']} threads)")
        if args.out:
            write_csv(args.out, rows)
            run.log_artifact(args.out)
            print(f"wrote {args.out}")


def register(cli) -> None:
    def tracked(sp):
        sp.add_argument("--tracking", help="JSON of the `tracking` config section (uri, experiment); omit: no MLflow")
        return sp

    def threads(sp):
        sp.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
        return sp

    sp = cli.add("sft trajectories", cmd_sft_trajectories, "teacher trajectories through the rollout loop: episodes + "
                 "stats")
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

    sp = tracked(cli.add("sft examples", cmd_sft_examples, "kept trajectories -> de-duplicated turn-level examples"))
    sp.add_argument("--episodes", required=True, help="trajectories (records parquet)")
    sp.add_argument("--teacher", required=True, help="name of the teacher that played them (stats column)")
    sp.add_argument("--out", required=True, help="examples (records parquet, one call per episode)")
    sp.add_argument("--stats", required=True, help="JSON stats")
    sp.add_argument("--table", help="CSV row: teacher, trajectories_generated, trajectories_kept, turn_examples")

    sp = cli.add("sft merge-trajectories", cmd_sft_merge_trajectories, "trajectory shards (sft trajectories --shard) "
                 "-> one file + stats")
    sp.add_argument("--shards", nargs="+", required=True, help="shard files (records parquet), in shard order")
    sp.add_argument("--shard-stats", nargs="+", required=True, help="their stats JSON, in the same order")
    sp.add_argument("--out", required=True, help="all episodes, in task order (records parquet)")
    sp.add_argument("--stats", required=True, help="JSON stats of all episodes")

    sp = cli.add("sft lm-data", cmd_sft_lm_data, "corpus passages (+ copy curriculum) -> LM pre-training examples")
    sp.add_argument("--corpus", required=True, help="corpus parquet (memopd retrieval corpus)")
    sp.add_argument("--tokenizer", required=True, help="tokenizer directory")
    sp.add_argument("--out", required=True, help="examples (records parquet)")
    sp.add_argument("--stats", required=True, help="JSON stats")

    sp = threads(tracked(cli.add("sft train", cmd_sft_train, "SFT of the student or teacher (resumes from its "
                                 "checkpoint)")))
    sp.add_argument("--role", required=True, choices=["student", "teacher"])
    sp.add_argument("--stage", default="sft", choices=["sft", "pretrain"],
                    help="pretrain: LM pre-training with the sft.pretrain budgets (examples from `sft lm-data`)")
    sp.add_argument("--examples", required=True)
    sp.add_argument("--init", required=True, help="initial model directory")
    sp.add_argument("--out", required=True, help="output model directory (checkpoints in OUT/checkpoint)")

    sp = cli.add("sft snapshot", cmd_sft_snapshot, "a snapshot of a finished SFT run (sft.<role>.snapshots) -> a model "
                 "directory of its own")
    sp.add_argument("--model", required=True, help="the run's model directory (its snapshots under snapshots/)")
    sp.add_argument("--step", type=int, required=True, help="the optimizer step after which it was taken")
    sp.add_argument("--out", required=True, help="output model directory")

    sp = threads(tracked(cli.add("sft eval", cmd_sft_eval, "held-out target loss of a model")))
    sp.add_argument("--role", required=True, choices=["student", "teacher"], help="whose batch settings to use")
    sp.add_argument("--name", required=True, help="model name in the results (student_init, student_sft, ...)")
    sp.add_argument("--model", required=True)
    sp.add_argument("--examples", required=True)
    sp.add_argument("--out", required=True, help="JSON result")

    sp = threads(tracked(cli.add("bench sft", cmd_bench_sft, "packed vs padded SFT tokens/s, side by side")))
    sp.add_argument("--model", required=True, help="model directory (e.g. the tiny student's init)")
    sp.add_argument("--data-dir", default="data", help="token pool: real text through the model's tokenizer")
    sp.add_argument("--examples", type=int, default=2000, help="synthetic turn examples")
    sp.add_argument("--max-bins", type=int, default=0, help="time only the first N batches (0: all)")
    sp.add_argument("--out", help="CSV file")
