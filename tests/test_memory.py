"""Memory-rewrite rules on a hand-made episode: exact contexts and exact provenance."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memopd.agent.memory import MemoryRuleError, Turn, build_input
from memopd.config import RULES, MemoryConfig
from memopd.inputs import ConfigError, UsageError
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


def test_a_users_rule_by_import_path_builds_its_context():
    """agent.rule names a function in the user's module; its result by hand: the two last <think> blocks (call 1
    wrote none) and the newest observation, the copied block recorded as retained."""
    cfg = MemoryConfig("user_memory_rules:two_thinks")
    assert build_input(Q, H, cfg) == (Q + [30, 31, 32, 93, 94], [Retained(2, 0, 3, 3)])
    assert build_input(Q, H[:1], cfg) == (Q + [10, 11, 90, 91], [Retained(0, 0, 3, 2)])
    assert build_input(Q, [], cfg) == (Q, [])


@pytest.mark.parametrize("rule,says", [
    ("user_memory_rules:rewrites_prefix", "memory rule 'user_memory_rules:rewrites_prefix', call 3: the context "
     "changes the prefix"),
    ("user_memory_rules:claims_a_copy", "memory rule 'user_memory_rules:claims_a_copy', call 3: retained span "
     "Retained(src_call=2, src_start=0, dst_start=3, length=2) does not hold the source tokens"),
    ("user_memory_rules:no_such_rule", "agent.rule 'user_memory_rules:no_such_rule': cannot import it "
     "(AttributeError"),
    ("no_such_module_here:rule", "agent.rule 'no_such_module_here:rule': cannot import it (ModuleNotFoundError"),
])
def test_a_rule_that_breaks_the_contract_is_named(rule, says):
    with pytest.raises(MemoryRuleError) as e:
        build_input(Q, H, MemoryConfig(rule))
    assert str(e.value).startswith(says), str(e.value)


def test_a_rule_that_is_neither_built_in_nor_an_import_path_is_a_config_error():
    with pytest.raises(ConfigError, match="agent.rule 'summary': neither a built-in rule"):
        MemoryConfig("summary")


def test_the_workflow_schema_takes_a_users_rule_and_refuses_a_misspelt_one():
    from memopd.schema import merge_files, validate

    cfg = merge_files([Path(__file__).parents[1] / "config/config.yaml"])
    for rule, ok in (("mypkg.rules:two_thinks", True), ("sliding_window", True), ("summary", False)):
        cfg["agent"]["rule"] = rule
        if ok:
            validate(cfg)
        else:
            with pytest.raises(UsageError, match="config agent.rule: 'summary'"):
                validate(cfg)
