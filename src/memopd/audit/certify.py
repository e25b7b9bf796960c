"""`memopd certify`: a packer (a function from episodes to the rows a trainer scores) checked on random episodes
under each of the five memory rules and on real ones from a ledger: every sampled token must land on its own call's
exact state, once, with the batch's log-prob equal to the exact one within the dtype's tolerance; and one update at
lr = 0 (behaviour = the exact log-probs, the same weights) must give ratio 1 and no clipped token."""
from __future__ import annotations

import importlib
import math
import random

from memopd.audit.batch import audit
from memopd.config import RULES
from memopd.ledger import LedgerEpisode, read_ledger, write_ledger


def load_packer(spec: str):
    """`module:function` -> the function; a spec that names nothing is a ValueError naming it."""
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--packer {spec!r}: no such function ({type(e).__name__}: {e})") from None


def random_ledger(path, vocab: int, seed: int = 0, per_rule: int = 2) -> list[LedgerEpisode]:
    """Random episodes under each memory rule (memopd.synthetic), written as a ledger and read back."""
    from memopd.synthetic import random_episode

    rng = random.Random(seed)
    pool = list(range(3, vocab))
    eps = [random_episode(rng, pool, rule, 4, 8, (4, 12), (3, 8), task_id=f"{rule}-{i}")
           for rule in RULES for i in range(per_rule)]
    write_ledger(path, eps, {"temperature": 1.0, "top_p": 1.0, "top_k": 0})
    return read_ledger(path)[1]


def certify(model, packer, ledgers: dict[str, list[LedgerEpisode]], tol: float = 1e-4, clip: float = 0.2) -> dict:
    """The certificate: per ledger (random, real) the placement and the lr = 0 update's ratio statistics."""
    out = {"tolerance": tol, "clip": clip, "ledgers": {}}
    for name, episodes in ledgers.items():
        rows = packer([e.to_episode() for e in episodes])
        r = audit(model, rows, episodes)
        rep = r["numbers"]["representation"]
        d = rep["max_abs_dlogp"]  # the ratio new / old at lr = 0 is exp(batch - exact) for every token
        ratio = max(math.expm1(d), -math.expm1(-d)) if rep["tokens"] else math.nan
        exact = r["placement"]["counts"]["exact"] == sum(r["placement"]["counts"].values())
        ok = exact and r["placement"]["trains_once"] and rep["tokens"] > 0 and rep["max_abs_dlogp"] <= tol
        out["ledgers"][name] = {"episodes": len(episodes), "placement": r["placement"], "max_abs_dlogp":
                                rep["max_abs_dlogp"], "max_abs_ratio_minus_1": ratio,
                                f"clip_fraction_{clip:g}": rep.get(f"false_clip_{clip:g}", float("nan")), "passed": ok}
    out["passed"] = all(v["passed"] for v in out["ledgers"].values())
    return out
