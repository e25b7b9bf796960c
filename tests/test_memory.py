"""Memory-rewrite rules on a hand-made episode: exact contexts and exact provenance."""
from __future__ import annotations

import pytest
import torch

from memopd.agent.memory import Turn, build_input
from memopd.config import RULES, MemoryConfig
from memopd.packing import ACTION, CONTEXT, pack
from memopd.records import Episode, Invocation, Retained

Q = [1, 2, 3]
# three finished calls: response ids, tokens of its leading <think> block, observation shown after it
H = [
    Turn([10, 11, 12, 13], 2, [90, 91]),
    Turn([20, 21, 22], 0, [92]),
    Turn([30, 31, 32, 33, 34], 3, [93, 94]),
]

EXPECTED = {  # (rule, calls of history used) -> (input ids of the next call, retained spans)
    ("full_retention", 3): (Q + [30, 31, 32, 33, 34, 93, 94], [Retained(2, 0, 3, 5)]),
    ("suffix_retention", 3): (Q + [33, 34, 93, 94], [Retained(2, 3, 3, 2)]),
    ("summary_replacement", 3): (Q + [30, 31, 32, 93, 94], [Retained(2, 0, 3, 3)]),
    ("summary_replacement", 2): (Q + [92], []),  # call 1 wrote no <think>: memory is lost
    ("sliding_window", 3): (Q + [20, 21, 22, 92, 30, 31, 32, 33, 34, 93, 94], [Retained(1, 0, 3, 3), Retained(2, 0, 7, 5)]),
    ("sliding_window", 1): (Q + [10, 11, 12, 13, 90, 91], [Retained(0, 0, 3, 4)]),
    ("retrieval_refresh", 3): (Q + [30, 31, 32, 93, 94], [Retained(2, 0, 3, 3)]),
    ("retrieval_refresh", 2): (Q + [10, 11, 92], [Retained(0, 0, 3, 2)]),  # memory kept from an older call
}


@pytest.mark.parametrize("rule,n", sorted(EXPECTED))
def test_rule_exact(rule, n):
    ids, retained = build_input(Q, H[:n], MemoryConfig(rule, suffix_tokens=2, window=2))
    assert (ids, retained) == EXPECTED[(rule, n)]


@pytest.mark.parametrize("rule", RULES)
def test_first_call_is_prefix_only(rule):
    assert build_input(Q, [], MemoryConfig(rule)) == (Q, [])


def test_suffix_longer_than_response_keeps_it_whole():
    ids, retained = build_input(Q, H[:2], MemoryConfig("suffix_retention", suffix_tokens=50))
    assert ids == Q + [20, 21, 22, 92] and retained == [Retained(1, 0, 3, 3)]


def test_unknown_rule_rejected():
    with pytest.raises(ValueError):
        MemoryConfig("keep_everything")


@pytest.mark.parametrize("rule", RULES)
def test_rewritten_episode_packs_with_context_copies(rule):
    """Calls built by a rule validate as an Episode; in the pack, sampled responses are actions and
    their retained copies are context (from provenance)."""
    cfg = MemoryConfig(rule, suffix_tokens=2, window=2)
    invs = []
    for t in range(len(H) + 1):
        ids, retained = build_input(Q, H[:t], cfg)
        out = H[t].output_ids if t < len(H) else [40, 41]
        invs.append(Invocation(ids, out, retained=retained))
    ep = Episode("hand", len(Q), invs).validate()
    p = pack(ep)
    n_out = sum(len(i.output_ids) for i in invs)
    n_copy = sum(r.length for i in invs for r in i.retained)
    assert int(p.act_mask.sum()) == n_out
    assert torch.equal(p.targets, torch.tensor([t for i in invs for t in i.output_ids]))
    assert int((p.role == CONTEXT).sum()) == sum(len(i.input_ids) - len(Q) for i in invs)
    # every response token id that was copied appears again in the pack as context, not as action
    copies = [(t, r) for t, i in enumerate(invs) for r in i.retained]
    assert len(copies) > 0
    for t, r in copies:
        in_call = (p.call == t).nonzero().squeeze(-1)
        dst = in_call[r.dst_start - len(Q) : r.dst_start - len(Q) + r.length]
        assert (p.role[dst] == CONTEXT).all() and not (p.role[dst] == ACTION).any()
        assert p.position_ids[dst].tolist() == list(range(r.dst_start, r.dst_start + r.length))
