"""Known-value tests of the packing compiler on hand-made episodes."""
import pytest
import torch

from memopd.attention import dense_mask
from memopd.packing import ACTION, CONTEXT, PREFIX, PackingLimitError, corrupt, flatten_persistent, pack
from memopd.records import Episode, Invocation, Retained


def _episode():
    # q = [1, 2, 3]; call 0: x0 = [4, 5] -> a0 = [10, 11, 12];
    # call 1: x1 = [11, 12, 6] where [11, 12] is a0's suffix retained by the memory rewrite -> a1 = [13]
    q = [1, 2, 3]
    return Episode("hand", 3, [
        Invocation(q + [4, 5], [10, 11, 12]),
        Invocation(q + [11, 12, 6], [13], retained=[Retained(0, 1, 3, 2)]),
    ])


def test_known_layout():
    p = pack(_episode())
    assert p.input_ids.tolist() == [1, 2, 3, 4, 5, 10, 11, 12, 11, 12, 6, 13]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 6]
    assert p.call.tolist() == [-1, -1, -1, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    P, C, A = PREFIX, CONTEXT, ACTION
    assert p.role.tolist() == [P, P, P, C, C, A, A, A, C, C, C, A]
    # the retained copy [11, 12] at 8..9 is context, not action, although its ids equal a0's
    assert p.action_index.tolist() == [5, 6, 7, 11]
    assert p.gamma.tolist() == [-1, -1, -1, -1, -1, 4, 5, 6, -1, -1, -1, 10]
    assert p.pred_index.tolist() == [4, 5, 6, 10]
    assert p.targets.tolist() == [10, 11, 12, 13]
    assert p.teacher_mask.tolist() == p.act_mask.tolist()


def test_known_visibility():
    m = dense_mask(pack(_episode()))[0, 0]
    assert m[8].nonzero().squeeze(-1).tolist() == [0, 1, 2, 8]  # call 1 sees q, not call 0
    assert m[11].nonzero().squeeze(-1).tolist() == [0, 1, 2, 8, 9, 10, 11]
    assert m[7].nonzero().squeeze(-1).tolist() == list(range(8))
    assert m[2].nonzero().squeeze(-1).tolist() == [0, 1, 2]
    additive = dense_mask(pack(_episode()), additive=True)[0, 0]
    assert additive.dtype == torch.float32 and additive[8, 3] == torch.finfo(torch.float32).min and additive[8, 2] == 0


def test_empty_context_predicts_from_the_prefix():
    q = [1, 2, 3]
    p = pack(Episode("e", 3, [Invocation(q, [7, 8]), Invocation(q, [9])]))
    assert p.input_ids.tolist() == [1, 2, 3, 7, 8, 9]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 3]
    assert p.pred_index.tolist() == [2, 3, 2]


def test_persistent_flattening_and_corruptions():
    ep = _episode()
    flat = flatten_persistent(ep)
    assert flat.position_ids.tolist() == list(range(12))
    assert dense_mask(flat)[0, 0].equal(torch.tril(torch.ones(12, 12, dtype=torch.bool)))
    assert flat.action_index.equal(pack(ep).action_index)  # same action tokens, other states
    vis = corrupt(pack(ep), visibility=True, positions=False)
    assert vis.layout == "corrupt_visibility" and vis.position_ids.equal(pack(ep).position_ids)
    assert bool(dense_mask(vis)[0, 0, 8, 5])  # leaks call 0 into call 1
    posc = corrupt(pack(ep), visibility=False, positions=True)
    assert posc.layout == "corrupt_positions" and posc.position_ids.tolist() == list(range(12))
    assert not bool(dense_mask(posc)[0, 0, 8, 5])
    both = corrupt(pack(ep), visibility=True, positions=True)
    assert both.position_ids.equal(flat.position_ids) and dense_mask(both).equal(dense_mask(flat))


def test_several_episodes_share_one_sequence_without_seeing_each_other():
    a, b = _episode(), Episode("b", 2, [Invocation([5, 6, 7], [8])])
    p = pack([a, b])
    assert p.input_ids.tolist()[12:] == [5, 6, 7, 8]
    assert p.position_ids.tolist()[12:] == [0, 1, 2, 3]
    assert p.segment.tolist() == [0] * 12 + [1] * 4
    assert p.pred_index.tolist() == [4, 5, 6, 10, 14]
    m = dense_mask(p)[0, 0]
    assert m[15].nonzero().squeeze(-1).tolist() == [12, 13, 14, 15]


def test_over_the_limit_is_a_typed_error_never_truncation():
    with pytest.raises(PackingLimitError) as e:
        pack(_episode(), max_len=11)
    assert (e.value.needed, e.value.limit, e.value.task_ids) == (12, 11, ["hand"])
    assert len(pack(_episode(), max_len=12)) == 12


@pytest.mark.parametrize("spec, calls", [("all", [0, 1]), ("none", []), ("first", [0]), ("last", [1]), ([1], [1])])
def test_teacher_mask_selection_is_a_subset_of_actions(spec, calls):
    p = pack(_episode(), teacher=spec)
    assert sorted(set(p.call[p.teacher_mask].tolist())) == calls
    assert not (p.teacher_mask & ~p.act_mask).any()


def test_teacher_fraction_is_seeded():
    ep = Episode("f", 1, [Invocation([1, 2], [3]) for _ in range(40)])
    a, b = pack(ep, teacher=0.5, seed=3), pack(ep, teacher=0.5, seed=3)
    assert a.teacher_mask.equal(b.teacher_mask)
    assert 0 < int(a.teacher_mask.sum()) < 40
    with pytest.raises(ValueError):
        pack(ep, teacher=[40])


def test_unknown_layout_rejected():
    with pytest.raises(ValueError, match="unknown layout"):
        pack(_episode(), layout="sideways")
