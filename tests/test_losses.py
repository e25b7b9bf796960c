"""Known values of the PPO / MemOPD losses."""
import math

import pytest
import torch
import torch.nn.functional as F

from memopd.losses import (action_logprobs_entropy, actor_loss, gae, opd_loss, ppo_policy_loss,
                           reference_penalty, reverse_kl, token_rewards, value_loss)


def _heads(h=16, v=50, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(h, v, bias=False), torch.nn.Linear(h + 8, v, bias=False)


def test_reverse_kl_matches_kl_div_and_chunking():
    s_head, t_head = _heads()
    hs, ht = torch.randn(37, 16), torch.randn(37, 24)
    ls, lt = torch.log_softmax(s_head(hs), -1), torch.log_softmax(t_head(ht), -1)
    want = F.kl_div(lt, ls, log_target=True, reduction="none").sum(-1)  # KL(p_s || p_t)
    for chunk in (1, 5, 37, 100):
        torch.testing.assert_close(reverse_kl(hs, s_head, ht, t_head, chunk_size=chunk), want, atol=1e-6, rtol=1e-5)


def test_reverse_kl_is_zero_for_identical_distributions():
    s_head, _ = _heads()
    h = torch.randn(9, 16)
    assert reverse_kl(h, s_head, h, s_head).abs().max() < 1e-6


# Qwen2.5-3B (student) and Qwen2.5-7B (teacher): one tokenizer of 151,665 ids, heads padded differently
QWEN_3B_ROWS, QWEN_7B_ROWS, QWEN_VOCAB = 151_936, 152_064, 151_665


def _kl_over(ls, lt, v):
    """Independent reference: KL(p_s || p_t) of the two softmaxes over the first v logits."""
    return F.kl_div(torch.log_softmax(lt[:, :v], -1), torch.log_softmax(ls[:, :v], -1), log_target=True,
                    reduction="none").sum(-1)


def test_reverse_kl_over_the_shared_vocabulary_of_differently_padded_heads():
    """A 151,936-row student head vs a 152,064-row teacher head (small hidden sizes): the KL runs over the
    shared ids, len(tokenizer) when given, else the rows both heads have (failed before: the two
    log-softmaxes do not broadcast, so paper-scale OPD crashed)."""
    torch.manual_seed(0)
    s_head, t_head = torch.nn.Linear(8, QWEN_3B_ROWS), torch.nn.Linear(12, QWEN_7B_ROWS)
    hs, ht = torch.randn(6, 8, requires_grad=True), torch.randn(6, 12)
    with torch.no_grad():
        ls, lt = s_head(hs), t_head(ht)
    for vocab, v in ((None, QWEN_3B_ROWS), (QWEN_VOCAB, QWEN_VOCAB)):
        got = reverse_kl(hs, s_head, ht, t_head, chunk_size=4, vocab=vocab)
        torch.testing.assert_close(got, _kl_over(ls, lt, v), atol=1e-6, rtol=1e-5)
    loss, _ = opd_loss(hs, s_head, ht, t_head, vocab=QWEN_VOCAB)
    loss.backward()
    assert s_head.weight.grad[QWEN_VOCAB:].abs().max() == 0  # padded rows: masked out, no gradient
    assert s_head.weight.grad[:QWEN_VOCAB].abs().max() > 0
    with pytest.raises(ValueError, match="shared vocabulary"):
        reverse_kl(hs, s_head, ht, t_head, vocab=QWEN_3B_ROWS + 1)


def test_shared_vocabulary_kl_is_the_policys_own_kl_when_padded_rows_hold_no_mass():
    """What is computed, for a student whose padded rows carry no probability (a trained model): the KL of
    its full-head softmax (the policy, not renormalised) against the teacher's softmax over the real ids."""
    torch.manual_seed(1)
    s_head, t_head = torch.nn.Linear(8, 40), torch.nn.Linear(12, 48)
    with torch.no_grad():
        s_head.bias[30:] = -1e4  # padded rows of the student: exp(-1e4) = 0
    hs, ht = torch.randn(5, 8), torch.randn(5, 12)
    policy = torch.log_softmax(s_head(hs), -1)[:, :30]  # the policy over its whole head, at the real ids
    target = torch.log_softmax(t_head(ht)[:, :30], -1)
    want = (policy.exp() * (policy - target)).sum(-1)
    torch.testing.assert_close(reverse_kl(hs, s_head, ht, t_head, vocab=30), want.detach(), atol=1e-6, rtol=1e-5)


def test_chunked_gradients_equal_unchunked():
    s_head, t_head = _heads()
    hs = torch.randn(23, 16, requires_grad=True)
    ht = torch.randn(23, 24)
    grads = []
    for chunk in (4, 1000):
        s_head.zero_grad()
        hs.grad = None
        loss, _ = opd_loss(hs, s_head, ht, t_head, chunk_size=chunk)
        loss.backward()
        grads.append((hs.grad.clone(), s_head.weight.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert t_head.weight.grad is None  # the teacher is frozen


def test_action_logprobs_and_entropy_known_values():
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    h = torch.tensor([[0.0, 0.0], [math.log(2.0), 0.0]])
    lp, ent = action_logprobs_entropy(h, head, torch.tensor([2, 0]), chunk_size=1)
    torch.testing.assert_close(lp, torch.tensor([math.log(1 / 3), math.log(2 / 4)]))
    torch.testing.assert_close(ent[0], torch.tensor(math.log(3.0)))
    p = torch.tensor([0.5, 0.25, 0.25])
    torch.testing.assert_close(ent[1], -(p * p.log()).sum())


def test_ppo_clip_against_a_hand_computation():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0])
    loss, m = ppo_policy_loss(logp, old, adv, clip=0.2)
    # ratio 1.5, A>0 -> clipped to 1.2: -1.2 | ratio 0.5, A>0 -> min(0.5, 0.8) -> -0.5
    # ratio 1.1, A<0 -> max(2.2, 2.2) = 2.2 | ratio 0.7, A<0 -> max(0.7, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2 + 0.8) / 4)
    assert m["ppo/clipfrac"] == pytest.approx(2 / 4)


def test_value_loss_clips():
    loss, _ = value_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([1.0]), clip=0.5)
    # unclipped (2-1)^2 = 1, clipped (0.5-1)^2 = 0.25 -> max = 1 -> 0.5
    assert loss.item() == pytest.approx(0.5)


def test_reference_penalty_is_the_positive_part():
    got = reference_penalty(torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-2.0, -2.0, -1.0]))
    assert got.tolist() == [1.0, 0.0, 0.0]


def test_token_rewards_put_the_score_on_the_last_action():
    old, ref = torch.tensor([-1.0, -1.0, -1.0, -1.0]), torch.tensor([-1.5, -1.0, -1.0, -0.5])
    r = token_rewards(torch.tensor([0.8, 0.3]), torch.tensor([1, 3]), old, ref, beta=0.1)
    torch.testing.assert_close(r, torch.tensor([-0.05, 0.8, 0.0, 0.3]))


def test_gae_known_values():
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.25, 0.5])
    adv, ret = gae(rewards, values, torch.zeros(3, dtype=torch.long), gamma=0.9, gae_lambda=0.8)
    d2 = 1.0 - 0.5
    d1 = 0.0 + 0.9 * 0.5 - 0.25
    d0 = 0.0 + 0.9 * 0.25 - 0.5
    a2, a1 = d2, d1 + 0.72 * d2
    torch.testing.assert_close(adv, torch.tensor([d0 + 0.72 * a1, a1, a2]))
    torch.testing.assert_close(ret, adv + values)


def test_gae_restarts_at_episode_boundaries():
    adv, _ = gae(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), torch.tensor([0, 1]))
    assert adv.tolist() == [1.0, 2.0]


def test_actor_loss_with_zero_lambda_is_ppo_minus_entropy():
    logp, old, adv, ent = torch.randn(5), torch.randn(5), torch.randn(5), torch.rand(5)
    a, _ = actor_loss(logp, old, adv, ent, opd=torch.tensor(3.0), clip=0.2, entropy_coef=0.01, opd_lambda=0.0)
    b, _ = actor_loss(logp, old, adv, ent, opd=None, clip=0.2, entropy_coef=0.01, opd_lambda=0.0)
    c, _ = actor_loss(logp, old, adv, ent, opd=torch.tensor(3.0), clip=0.2, entropy_coef=0.01, opd_lambda=0.5)
    assert a.item() == b.item()
    assert c.item() == pytest.approx(b.item() + 1.5)
    # lambda 0 leaves the OPD term out of the loss, not in at weight 0: a non-finite KL cannot reach PPO's loss
    d, _ = actor_loss(logp, old, adv, ent, opd=torch.tensor(float("inf")), clip=0.2, entropy_coef=0.01, opd_lambda=0.0)
    assert d.item() == b.item()


def test_opd_mean_is_over_the_minibatch_teacher_tokens():
    """Two episodes with 3 and 7 teacher rows: the summed per-episode shares (denom = 10, the
    minibatch's teacher tokens) equal the paper's (1 / sum m_T) sum_j KL_j, computed here with a plain
    loop over rows and F.kl_div; a mean of per-episode means would weigh the 3 rows like the 7."""
    s_head, t_head = _heads()
    hs, ht = torch.randn(10, 16), torch.randn(10, 24)
    parts = [(slice(0, 3)), (slice(3, 10))]
    got = sum(opd_loss(hs[p], s_head, ht[p], t_head, denom=10)[0] for p in parts)
    ls, lt = torch.log_softmax(s_head(hs), -1), torch.log_softmax(t_head(ht), -1)
    total = 0.0
    for j in range(10):
        total += F.kl_div(lt[j], ls[j], log_target=True, reduction="sum").item()
    assert got.item() == pytest.approx(total / 10, rel=1e-5)
    per_episode_means = sum(opd_loss(hs[p], s_head, ht[p], t_head)[0] for p in parts) / 2
    assert abs(per_episode_means.item() - total / 10) > 1e-4  # the two means differ here
