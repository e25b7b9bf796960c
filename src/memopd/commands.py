"""The commands of the top-level modules: `memopd tokenizer`, `model init`, `model base` (models), `rce` (rce),
`prefetch` (prefetch) and `tracking init` (tracking)."""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

from memopd.config import (HubConfig, PackagedModelConfig, RCEConfig, TinyModelConfig, TokenizerConfig,
                           model_config)
from memopd.inputs import UsageError, existing, require
from memopd.outputs import write_csv, write_json


def cmd_tokenizer(args, cfg):
    from memopd.data import corpus_texts
    from memopd.models import train_tokenizer

    tc = TokenizerConfig.from_dict(cfg)
    existing(args.data_dir)
    texts = corpus_texts(args.data_dir, tc.files)
    if tc.prompts:
        from memopd.agent.protocol import protocol_texts

        texts = itertools.chain(protocol_texts(), texts)
    tok = train_tokenizer(texts, tc.vocab_size, args.out, min_frequency=tc.min_frequency)
    write_json(Path(args.out) / "memopd_tokenizer.json", {"config": cfg, "data_dir": args.data_dir, "size": len(tok)})
    print(f"tokenizer: {len(tok)} tokens -> {args.out}")


def cmd_model_init(args, cfg):
    from memopd.models import init_model

    if isinstance(model_config(cfg), TinyModelConfig):  # its sizes from the config, its ids from the tokenizer
        if args.tokenizer is None:
            raise UsageError("a tiny model (no 'pretrained' in the config) needs --tokenizer")
        existing(args.tokenizer)
    info = init_model(cfg, args.out, seed=args.seed, tokenizer_path=args.tokenizer, offline=not args.online)
    print(f"model: {info['architecture']} with {info['params']:,} parameters -> {args.out}")


def cmd_model_base(args, cfg):
    from memopd.models import packaged_model

    b = PackagedModelConfig.from_dict(cfg)
    info = packaged_model(cfg, args.out)
    print(f"base model: {info['architecture']} with {info['params']:,} parameters from {b.package}=="
          f"{b.version} ({b.file}, sha256 checked) -> {args.out}")


def cmd_rce(args, cfg):
    import torch

    from memopd.models import default_device, load_model
    from memopd.rce import rce_report, report_rows
    from memopd.synthetic import random_episode, token_pool

    rc = RCEConfig.from_dict(cfg)
    existing(args.model, args.data_dir)
    torch.manual_seed(args.seed)
    model = load_model(args.model, dtype=rc.dtype, device=args.device or default_device())
    pool = token_pool(args.model, args.data_dir)
    rng = random.Random(args.seed)
    rules = rc.rules
    episodes = [
        random_episode(rng, pool, rules[i % len(rules)], rc.calls, rc.prefix_tokens, rc.observation_tokens,
                       rc.response_tokens, task_id=f"smoke{i}-{rules[i % len(rules)]}")
        for i in range(rc.episodes)
    ]
    report = rce_report(model, episodes, list(rc.backends), dtype=rc.dtype, tolerance=rc.tolerance)
    report["config"] = {**cfg, "seed": args.seed, "model": args.model}
    write_json(args.out, report)
    write_csv(Path(args.out).with_suffix(".csv"), report_rows(report))
    tols = (f"{report['dtype']} tolerances: max |d log p| <= {report['tolerance_dlogp']:g}, "
            f"max |d logit| <= {report['tolerance_dlogit']:g}")
    print(tols)
    for name, r in report["backends"].items():
        print(f"{name:14s} max|dlogp| {r['max_abs_dlogp']:.2e}  p99 {r['p99_abs_dlogp']:.2e}  "
              f"max|dlogit| {r['max_abs_dlogit']:.2e}  top1 {r['top1_agreement']:.3f}  "
              f"tokens {r['action_tokens']}  {'PASS' if r['passed'] else 'FAIL on ' + ', '.join(r['failed_on'])}")
    if not report["passed"] and args.strict:
        sys.exit(f"RCE failed ({tols}); report in {args.out}")


def cmd_tracking_init(args, cfg):
    from memopd.tracking import TrackingConfig, init_store, resolve_uri

    require(cfg, "uri", "experiment")
    info = init_store(resolve_uri(cfg["uri"], cfg.get("sqlite_in_slurm_jobs", TrackingConfig.sqlite_in_slurm_jobs)),
                      cfg["experiment"])
    write_json(args.out, {**info, "config": cfg})
    print(f"tracking store {info['tracking_uri']}: experiment {info['experiment']!r} (id {info['experiment_id']}); "
          f"in `mlflow ui`: http://127.0.0.1:5000/{info['ui_path']}")


def cmd_tracking_replay(args, cfg):
    """What jobs could not send to the tracking store (their spools: memopd.spool), sent now into the same runs;
    --cfg {"uri": ...} sends them to another address of the store (a server that moved)."""
    from memopd.spool import replay, spool_files
    from memopd.tracking import TrackingConfig, bounded_http

    # a server that is down is refused in seconds (MLflow's own retries would hold each record for minutes)
    bounded_http(TrackingConfig.__dataclass_fields__["http_timeout_s"].default)
    files = spool_files(args.spool)
    existing(*files)
    failed = []
    for f in files:
        try:
            run_id = replay(f, cfg.get("uri"))
        except (ConnectionError, ValueError) as e:
            failed.append(str(e))
            print(f"tracking replay: {e}", file=sys.stderr)
            continue
        print(f"tracking replay: {f} -> run {run_id}")
    if failed:  # a replay is the last chance to record them: a failed one fails the command
        raise UsageError(f"{len(failed)} of {len(files)} spools not sent (kept): {failed[0]}")


def cmd_ledger_check(args, cfg):
    """A ledger checked against its format (memopd.ledger); one line naming the first break, exit 2."""
    from memopd.ledger import LedgerError, read_ledger

    try:
        head, episodes = read_ledger(args.ledger)
    except LedgerError as e:
        raise UsageError(str(e)) from None
    calls = sum(len(e.calls) for e in episodes)
    actions = sum(len(c.action_ids) for e in episodes for c in e.calls)
    with_lp = sum(len(c.action_ids) for e in episodes for c in e.calls if c.logprobs is not None)
    retained = sum(len(c.retained) for e in episodes for c in e.calls)
    print(f"{args.ledger}: ledger version {head['version']}, {len(episodes)} episodes, {calls} calls, {actions} action "
          f"tokens ({with_lp} with engine log-probs), {retained} retained spans: valid")


def cmd_ledger_write(args, cfg):
    """Our rollouts' episodes (records parquet) as a ledger; --cfg: the `rollout` section (its sampling)."""
    from memopd.ledger import write_ledger
    from memopd.records import load_episodes

    existing(args.episodes)
    sampling = {k: cfg[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens") if k in cfg}
    episodes = load_episodes(args.episodes)
    for ep in episodes:
        ep.validate()
    write_ledger(args.out, episodes, sampling, args.tokenizer or "", args.weight_version)
    print(f"{len(episodes)} episodes of {args.episodes} -> {args.out}")


def cmd_prefetch(args, cfg):
    """`memopd prefetch`: --cfg {home, repos} (what the workflow's rule passes), or --config FILE (by hand, e.g.
    `memopd prefetch --config config/paper.yaml` on a login node before submitting anything)."""
    from memopd.inputs import ConfigError, section
    from memopd.prefetch import hub_repos, prefetch

    if args.config:
        from memopd.schema import merge_files

        full = merge_files([args.config])  # a layer with its base (config/README.md)
        if not full.get("hub"):
            raise ConfigError(f"{args.config} has no hub section: nothing to prefetch")
        section(full, "models")
        section(full, "retrieval", "corpus")
        section(full, "benchmarks", "sources")
        try:
            cfg = {"home": HubConfig.from_dict(full["hub"]).home, "repos": hub_repos(full)}
        except ValueError as e:  # a repository without a pinned commit
            raise ConfigError(str(e)) from None
    require(cfg, "home", "repos")
    try:
        prefetch(cfg["home"], cfg["repos"], args.out)
    except ValueError as e:  # a revision that is not a commit, a repository name the hub refuses
        raise ConfigError(str(e)) from None


def register(cli) -> None:
    sp = cli.add("tokenizer", cmd_tokenizer, "train the offline byte-level BPE tokenizer on data/")
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True)

    sp = cli.add("model init", cmd_model_init, "create a model directory (tiny from config, or pretrained by name)")
    sp.add_argument("--tokenizer", help="tokenizer directory (tiny models)")
    sp.add_argument("--online", action="store_true", help="allow downloads from the hub (paper scale)")
    sp.add_argument("--out", required=True)
    sp = cli.add("model base", cmd_model_base, "de-quantise the packaged base model (--cfg: config models.base) once")
    sp.add_argument("--out", required=True)

    sp = cli.add("rce", cmd_rce, "RCE smoke report: packed vs independent calls, every backend")
    sp.add_argument("--model", required=True)
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True, help="JSON report (a CSV is written beside it)")
    sp.add_argument("--strict", action="store_true", help="exit non-zero when any backend fails")
    sp.add_argument("--device", help="torch device of the model (default: the job's GPU if it has one, else cpu)")

    sp = cli.add("ledger check", cmd_ledger_check, "check an exact call ledger against its format (docs/ledger.md)")
    sp.add_argument("ledger", help="the ledger (JSON Lines)")
    sp = cli.add("ledger write", cmd_ledger_write, "our rollouts' episodes as an exact call ledger (--cfg: the "
                 "`rollout` section)")
    sp.add_argument("--episodes", required=True, help="episodes (records parquet: eval's *.episodes.parquet)")
    sp.add_argument("--tokenizer", help="the tokenizer's name, recorded in the header")
    sp.add_argument("--weight-version", type=int, help="the policy's weight version, recorded in the header")
    sp.add_argument("--out", required=True, help="the ledger (JSON Lines)")

    sp = cli.add("tracking init", cmd_tracking_init, "create the MLflow store and experiment once, before parallel jobs")
    sp.add_argument("--out", required=True, help="JSON record of the store")
    sp = cli.add("tracking replay", cmd_tracking_replay,
                 "send what jobs could not send to the MLflow store into the same runs (their spools)")
    sp.add_argument("--spool", nargs="+", required=True, help="spool files (*.jsonl) or directories holding them "
                    "(tracking.spool, default results/tracking/spool)")

    sp = cli.add("prefetch", cmd_prefetch, "download every hub repository of the config at its pinned revision into "
                 "the cache hub.home; write a manifest")
    sp.add_argument("--config", help="config YAML (e.g. config/paper.yaml); --cfg {home, repos} otherwise")
    sp.add_argument("--out", default="results/prefetch/manifest.json")
