"""`memopd bench decode`: the generation engine's own KV cache against transformers' (same outputs, time per call)."""
from __future__ import annotations

from memopd.inputs import existing
from memopd.outputs import write_csv


def cmd_bench_decode(args, cfg):
    import torch
    from transformers import AutoTokenizer

    from memopd.generation.decode_bench import run
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


def register(cli) -> None:
    sp = cli.add("bench decode", cmd_bench_decode, "HF generation: the backend's KV cache vs transformers' "
                 "DynamicCache (same outputs, time per call)")
    sp.add_argument("--model", default="results/models/base", help="a model directory (default: the base model)")
    sp.add_argument("--batch", type=int, default=32, help="rows generated together (rollout.batch_size)")
    sp.add_argument("--tokens", type=int, default=450, help="longest prompt; lengths spread over half to all of it")
    sp.add_argument("--new-tokens", type=int, default=48)
    sp.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats after one warm-up round")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sp.add_argument("--out", help="CSV file")
