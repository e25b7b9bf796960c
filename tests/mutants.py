"""Mutation check of the training update: apply single-line mutations of `train/update.py` and `losses.py`
one at a time to a temporary copy of the package and run the reference test (`test_ppo_reference.py`)
against it. Every mutant must make the test fail; the ones that survive are printed.

    .venv/bin/python tests/mutants.py            # all mutants; exit 1 if any survives
    .venv/bin/python tests/mutants.py -k entropy # those whose name contains "entropy"

The first six (reward placement, advantage normalisation, value clipping, entropy sign, value position,
teacher mask) are errors that leave the update's losses finite and plausible, so that only a test computing
the update independently is sure to catch them; the rest are further single-line errors of the same update.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PPO, LOSSES = "train/update.py", "losses.py"

# (name, file under src/memopd, original text, mutated text): each original occurs exactly once
MUTANTS = [
    ("task score on the first action token", PPO,
     "rewards = token_rewards(score, torch.tensor([n_actions - 1]), old, ref, cfg.beta)",
     "rewards = token_rewards(score, torch.tensor([0]), old, ref, cfg.beta)"),
    ("no advantage normalisation", PPO,
     "return [replace(target, advantages=(target.advantages - mean) / std) for target in targets]",
     "return [replace(target, advantages=target.advantages) for target in targets]"),
    ("no value clipping", LOSSES,
     "clipped = old_values + (values - old_values).clamp(-clip, clip)",
     "clipped = values"),
    ("entropy sign flipped", LOSSES,
     "loss = pg - entropy_coef * h",
     "loss = pg + entropy_coef * h"),
    ("value read at the action token", PPO,
     "return self.head(packed_hidden(self.lm, packed, backend)).squeeze(-1).float()",
     "return self.head(packed_hidden(self.lm, packed, backend, index=packed.action_index)).squeeze(-1).float()"),
    ("teacher mask ignored (every action row)", PPO,
     "teach_rows = packed.teacher_mask[packed.action_index]",
     "teach_rows = packed.act_mask[packed.action_index]"),
    ("OPD mean per episode instead of per minibatch teacher tokens", PPO,
     "_head(models.teacher) if teach else None, mb.teacher_tokens, cfg.vocab))",
     "_head(models.teacher) if teach else None, None, cfg.vocab))"),
    ("PPO ratio not clipped", LOSSES,
     "pg2 = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)",
     "pg2 = -advantages * ratio"),
    ("reference penalty not the positive part", LOSSES,
     "return (old_logp - ref_logp).clamp_min(0.0)",
     "return (old_logp - ref_logp)"),
    ("reference penalty sign flipped", LOSSES,
     "r = -beta * reference_penalty(old_logp, ref_logp)",
     "r = beta * reference_penalty(old_logp, ref_logp)"),
    ("GAE without lambda", LOSSES,
     "next_adv = delta + gamma * gae_lambda * next_adv",
     "next_adv = delta + gamma * next_adv"),
    ("forward KL instead of reverse KL", LOSSES,
     "return (logp_s.exp() * (logp_s - logp_t)).sum(-1)",
     "return (logp_t.exp() * (logp_t - logp_s)).sum(-1)"),
    ("persistent control scores the teacher on the exact state", PPO,
     "teacher_pack = packed if exact else pack(episode, layout=\"persistent\",",
     "teacher_pack = packed if True else pack(episode, layout=\"persistent\","),
    ("PPO and entropy averaged per episode", PPO,
     "denom = mb.actions if real else float(\"inf\")",
     "denom = (len(logp) * len(mb.episodes)) if real else float(\"inf\")"),
    ("teacher calls not seeded by the batch position", PPO,
     "packed = pack(episode, teacher=cfg.teacher_select, seed=cfg.seed + pos)",
     "packed = pack(episode, teacher=cfg.teacher_select, seed=cfg.seed)"),
]


def run_mutant(name: str, rel: str, old: str, new: str, python: str) -> tuple[bool, float]:
    """True if the mutant survives (the reference test passes on it)."""
    with tempfile.TemporaryDirectory(prefix="memopd-mutant-") as tmp:
        pkg = Path(tmp) / "memopd"
        shutil.copytree(ROOT / "src" / "memopd", pkg, ignore=shutil.ignore_patterns("__pycache__"))
        path = pkg / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"mutant {name!r}: the original text occurs {text.count(old)} times in {rel} "
                             "(the code changed: update tests/mutants.py)")
        path.write_text(text.replace(old, new))
        env = {**os.environ, "PYTHONPATH": tmp + os.pathsep + str(ROOT / "tests"), "PYTHONDONTWRITEBYTECODE": "1"}
        check = subprocess.run([python, "-c", "import memopd; print(memopd.__file__)"], env=env,
                               capture_output=True, text=True, check=True)
        assert check.stdout.strip().startswith(tmp), f"the mutant copy is not the imported package: {check.stdout}"
        t0 = time.perf_counter()
        res = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              str(ROOT / "tests" / "test_ppo_reference.py")], env=env, cwd=tmp,
                             capture_output=True, text=True)
        return res.returncode == 0, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only mutants whose name contains this")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k in m[0]]
    survivors = []
    for name, rel, old, new in chosen:
        survived, secs = run_mutant(name, rel, old, new, sys.executable)
        print(f"{'SURVIVED' if survived else 'killed  '}  {secs:5.1f} s  {rel:12s} {name}", flush=True)
        if survived:
            survivors.append(name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants killed, {len(survivors)} surviving"
          + (f": {survivors}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
