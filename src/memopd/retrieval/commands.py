"""`memopd retrieval corpus | index | recall | search` (config section `retrieval`) and `memopd bench index`."""
from __future__ import annotations

from memopd.config import RetrievalConfig
from memopd.inputs import existing, require, section
from memopd.outputs import write_csv


def cmd_retrieval_corpus(args, cfg: dict):
    from memopd.retrieval.steps import corpus_step

    require(cfg, "corpus", where="retrieval")
    existing(args.data_dir)
    corpus_step(RetrievalConfig.from_dict(cfg), args.data_dir, args.out)


def cmd_retrieval_index(args, cfg: dict):
    from memopd.retrieval.steps import index_step

    typed = RetrievalConfig.from_dict(cfg)
    existing(args.corpus)
    index_step(typed, cfg, args.corpus, args.out, online=args.online)


def cmd_retrieval_recall(args, cfg: dict):
    from memopd.retrieval.steps import recall_step

    section(cfg, "recall", "sources")
    typed = RetrievalConfig.from_dict(cfg)
    existing(args.index, args.data_dir)
    recall_step(typed, args.index, args.data_dir, args.seed, args.out, args.timing, args.hits)


def cmd_retrieval_search(args, cfg):
    from memopd.retrieval.steps import search_step

    existing(args.index)
    search_step(args.index, args.query, args.k)


def cmd_bench_index(args, cfg):
    from memopd.retrieval.index_bench import run

    rows = run(sizes=args.sizes, dim=args.dim, shard=args.shard, queries=args.queries)
    if args.out:
        write_csv(args.out, rows)
        print(f"wrote {args.out}")


def register(cli) -> None:
    sp = cli.add("retrieval corpus", cmd_retrieval_corpus, "de-duplicated passage corpus with stable ids (parquet)")
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True)
    sp = cli.add("retrieval index", cmd_retrieval_index, "build and save the index of the configured backend")
    sp.add_argument("--corpus", required=True)
    sp.add_argument("--out", required=True, help="index directory")
    sp.add_argument("--online", action="store_true", help="allow downloading the dense encoder (paper scale)")
    sp = cli.add("retrieval recall", cmd_retrieval_recall, "recall figures (NQ answer in top 5, HotpotQA support in "
                 "top 10) and timing")
    sp.add_argument("--index", required=True)
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True, help="CSV: dataset, metric, k, hits, total")
    sp.add_argument("--timing", required=True, help="CSV: build and query seconds")
    sp.add_argument("--hits", help="CSV: each sampled question's hit (dataset, qid, k, any, all), which an archive "
                    "keeps to rebuild the figures")
    sp = cli.add("retrieval search", cmd_retrieval_search, "print the top passages for queries, as the agent sees them")
    sp.add_argument("--index", default="results/retrieval/index")
    sp.add_argument("-k", type=int, default=3)
    sp.add_argument("query", nargs="+")

    sp = cli.add("bench index", cmd_bench_index, "dense index build: peak RSS and time per corpus size (synthetic "
                 "encoder, sharded build), and exact-search time")
    sp.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000], help="passages per corpus")
    sp.add_argument("--dim", type=int, default=768)
    sp.add_argument("--shard", type=int, default=10_000, help="passages per shard (retrieval.dense.shard_passages)")
    sp.add_argument("--queries", type=int, default=64, help="queries of the timed exact searches")
    sp.add_argument("--out", help="CSV file")
