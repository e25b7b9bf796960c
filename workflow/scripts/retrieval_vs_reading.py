"""Where an evaluation loses F1: retrieval (the gold answer never reached the agent) or reading (it did, and the
answer is wrong). Not a pipeline step: an analysis of `memopd eval` outputs
(docs/results.md "Where F1 is lost: reading, not retrieval").

    python workflow/scripts/retrieval_vs_reading.py MODEL_DIR results/eval/student_sft/q2_test

A question counts as seen when one of its gold aliases occurs (case-insensitive) in an <information> block of
its episode's inputs; right when its predicted answer is an exact match (memopd.metrics.exact_match). An answer
is a title copy when it equals (case-insensitive) the title of a passage its episode retrieved, the scripted
teacher's guess when no passage had the answer ("not found (guess: <Doc 1 title>)"); "Doc k" answers are
counted apart.
"""
import re
import sys

import pandas as pd
from transformers import AutoTokenizer

from memopd.agent.protocol import INFO, INFO_END
from memopd.teachers.scripted import passages
from memopd.metrics import exact_match, split_answers

_INFO = re.compile(re.escape(INFO) + "(.*?)" + re.escape(INFO_END), re.DOTALL)
_DOC_REF = re.compile(r"doc \d+")


def main(model_dir: str, stem: str) -> dict:
    tok = AutoTokenizer.from_pretrained(model_dir)
    episodes, table = pd.read_parquet(f"{stem}.episodes.parquet"), pd.read_csv(f"{stem}.csv", keep_default_na=False)
    out = {"questions": 0, "seen": 0, "seen_right": 0, "unseen_right": 0, "title_copies": 0, "title_copies_right": 0,
           "doc_refs": 0}
    calls = dict(list(episodes.groupby("task_id")))
    for row in table.itertuples():
        blocks = [b for ids in calls[row.task_id].input_ids for b in _INFO.findall(tok.decode(list(ids)))]
        seen_text = " ".join(blocks).lower()
        titles = {title.lower() for b in blocks for _, title, _ in passages(b)}
        preds = split_answers(row.predictions)
        for i, aliases in enumerate(g.split("|") for g in row.gold.split(" ; ")):
            seen = any(a and a.lower() in seen_text for a in aliases)
            right = i < len(preds) and bool(exact_match(preds[i], aliases))
            out["questions"] += 1
            out["seen"] += seen
            out["seen_right" if seen else "unseen_right"] += right
            pred = preds[i].strip().lower() if i < len(preds) else ""
            out["doc_refs"] += bool(_DOC_REF.fullmatch(pred))
            out["title_copies"] += pred in titles
            out["title_copies_right"] += pred in titles and right
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(main(sys.argv[1], sys.argv[2]))
