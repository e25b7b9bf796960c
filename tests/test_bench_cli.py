"""Every `memopd bench` command writes its --out CSV (opd-memory crashed after printing its figures:
its rows differ in columns), at a size that runs in seconds."""
import csv
import json
import os

import yaml

from agent_support import ROOT, random_student, tokenizer
from memopd.cli import main


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_bench_opd_memory_writes_every_row(tmp_path):
    out = tmp_path / "opd.csv"
    main(["bench", "opd-memory", "--tokens", "256", "--vocab", "2048", "--hidden", "32", "--chunk", "64", "--out", str(out)])
    rows = _rows(out)
    assert len(rows) == 4  # chunked at N, chunked and naive at the small N, naive scaled to N
    assert [r["scaled_from"] for r in rows].count("") == 3 and rows[-1]["scaled_from"] != ""
    assert all(float(r["extra_bytes"]) > 0 for r in rows)


def test_bench_packing_writes_every_path(tmp_path):
    out = tmp_path / "packing.csv"
    cfg = {"calls": [2], "prefix_tokens": [16], "response_tokens": 4, "observation_tokens": 6, "episodes": 1,
           "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": 128},
           "backends": ["sdpa", "prefix_shared"]}
    weights, cpus = tmp_path / "weights.json", os.sched_getaffinity(0)
    main(["bench", "packing", "--cfg", json.dumps(cfg), "--repeats", "2", "--threads", "1", "--out", str(out),
          "--weights-out", str(weights)])
    rows = _rows(out)
    paths = {r["path"] for r in rows}
    assert {"independent_batched", "packed_sdpa", "packed_prefix_shared"} <= paths
    timed = [r for r in rows if r["pass"] != "rce"]  # independent_sequential: its RCE only (DEFAULTS["untimed"])
    assert {r["path"] for r in rows if r["pass"] == "rce"} == {"independent_sequential"}
    assert all(float(r["seconds"]) > 0 and r["threads"] == "1" and r["repeats"] == "2" for r in timed)
    assert all(float(r["speedup_lo"]) <= float(r["speedup_vs_batched"]) <= float(r["speedup_hi"]) for r in timed)
    w = json.loads(weights.read_text())
    assert os.sched_getaffinity(0) == cpus  # pinned for the benchmark only
    assert w["device"] == "cpu" and w["threads"] == 1 and set(w["forward_backward"]) == {"lin", "attn", "inv", "copy", "dec"}


def test_bench_sft_writes_every_path(tmp_path):
    model = tmp_path / "model"
    random_student(0).save_pretrained(model)
    tokenizer().save_pretrained(model)
    out = tmp_path / "sft.csv"
    main(["bench", "sft", "--model", str(model), "--examples", "40", "--max-bins", "3", "--out", str(out),
          "--cfg", json.dumps({**yaml.safe_load((ROOT / "config/config.yaml").read_text())["sft"], "seq_len": 1024})])
    rows = _rows(out)
    assert {r["path"] for r in rows} == {"packed/segmented", "packed/sdpa", "padded"}
    assert all(int(r["batches"]) >= 1 and float(r["seconds"]) > 0 for r in rows)


def test_bench_decode_writes_its_row(tmp_path):
    model = tmp_path / "model"
    random_student(0).save_pretrained(model)
    tokenizer().save_pretrained(model)
    out = tmp_path / "decode.csv"
    main(["bench", "decode", "--model", str(model), "--batch", "4", "--tokens", "40", "--new-tokens", "6",
          "--repeats", "2", "--threads", "1", "--out", str(out)])
    (row,) = _rows(out)
    assert row["identical_outputs"] == "True" and row["repeats"] == "2" and row["threads"] == "1"
    assert float(row["growing_s"]) > 0 and float(row["dynamic_s"]) > 0 and float(row["prefill_s"]) > 0
    assert float(row["speedup_lo"]) <= float(row["speedup"]) <= float(row["speedup_hi"])


def test_bench_eval_writes_a_row_per_path(tmp_path):
    """Synthetic prompts (no benchmark, no index): one row per prefill path, the baseline's speedup exactly 1."""
    model = tmp_path / "model"
    random_student(0).save_pretrained(model)
    tokenizer().save_pretrained(model)
    out = tmp_path / "eval.csv"
    main(["bench", "eval", "--model", str(model), "--benchmark", str(tmp_path / "none.parquet"), "--batch", "5",
          "--tokens", "30", "--shared-tokens", "40", "--new-tokens", "6", "--repeats", "2", "--threads", "1",
          "--paths", "padded", "sorted", "shared", "--out", str(out)])
    rows = _rows(out)
    assert [r["path"] for r in rows] == ["padded", "sorted", "shared"]
    assert all(r["identical"] == "True" and r["repeats"] == "2" and r["work"] == "5 synthetic prompts" for r in rows)
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[0]["max_abs_dlogp"]) == 0.0
    assert all(0 < float(r["min_s"]) <= float(r["median_s"]) <= float(r["max_s"]) for r in rows)
