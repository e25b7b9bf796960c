"""The trainer's update (`memopd.train.update.ppo_update`) equals the naive reference (`ppo_reference.py`):
loss terms of every minibatch and the clipped gradients of policy and critic at every optimizer step,
for every method, teacher selection and exact backend, with a reference model that differs from
pi_old (nonzero KL penalty), several episodes of different lengths per minibatch, two PPO epochs (so
the ratio, PPO clipping and value clipping are active), fp32, within 1e-5 relative.
`tests/mutants.py` checks that single-line mutations of the update fail this test."""
import copy
import random

import pytest
import torch

import ppo_reference as reference
from memopd.synthetic import random_episode
from memopd.train.update import PPOConfig, ValueModel, ppo_update

RTOL = 1e-5


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the (clipped) gradients it steps with."""

    def __init__(self, params, lr):
        super().__init__(list(params), lr=lr)
        self.grads: list[list[torch.Tensor | None]] = []

    def step(self, closure=None):
        self.grads.append([None if p.grad is None else p.grad.detach().clone()
                           for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _lm(hidden, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=False, use_sliding_window=False,
                                        attn_implementation="sdpa")).eval()


def _models():
    policy = _lm(32, 0)
    ref = copy.deepcopy(policy)
    with torch.no_grad():  # a reference that differs from pi_old: the KL penalty is nonzero
        g = torch.Generator().manual_seed(1)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    critic = ValueModel(copy.deepcopy(policy))
    with torch.no_grad():  # a critic that already predicts something (the head starts at zero)
        critic.head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    return policy, ref, critic, _lm(48, 3)


def _episodes(n=4, seed=0):
    rng = random.Random(seed)
    pool = [rng.randrange(128) for _ in range(1000)]
    eps = [random_episode(rng, pool, "summary_replacement", rng.randint(2, 4), 6, (2, 6), (2, 7), task_id=f"e{i}")
           for i in range(n)]
    for e in eps:
        e.reward = rng.random()
    return eps


CASES = [  # (method, teacher_select, backend)
    ("ppo", "all", "sdpa"),
    ("memopd", "all", "prefix_shared"),
    ("memopd", "first", "sdpa"),
    ("memopd", "last", "prefix_shared"),
    ("memopd", 0.5, "sdpa"),
    ("memopd_persistent", 0.5, "prefix_shared"),
    ("memopd_persistent", "last", "sdpa"),
    ("memopd", "all", "auto"),
    ("memopd_persistent", "all", "auto"),  # the teacher's flattening: auto must leave the blocked-call paths
    ("ppo", "all", "calls"),
]


def _cfg(method, select, backend):
    return PPOConfig(method=method, teacher_select=select, attention=backend, opd_lambda=0.7, clip=0.1, value_clip=0.05,
                     entropy_coef=0.03, beta=0.2, gamma=0.9, gae_lambda=0.8, ppo_epochs=2, minibatch_episodes=3,
                     max_grad_norm=5.0, rce_sample=0, seed=3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _run(method, select, backend):
    cfg = _cfg(method, select, backend)
    eps = _episodes(5)
    runs = {}
    for who in ("trainer", "reference"):
        policy, ref, critic, teacher = _models()
        a_opt, c_opt = RecordingSGD(policy.parameters(), 0.5), RecordingSGD(critic.parameters(), 0.5)
        if who == "trainer":
            out = ppo_update(copy.deepcopy(eps), policy, ref, critic, teacher, a_opt, c_opt, cfg)
        else:
            out = reference.update(copy.deepcopy(eps), policy, ref, critic, teacher, a_opt, c_opt, cfg)
        runs[who] = (out, a_opt.grads, c_opt.grads, policy, critic)
    return cfg, runs


@pytest.mark.parametrize("method,select,backend", CASES)
def test_the_update_equals_the_naive_reference(method, select, backend):
    cfg, runs = _run(method, select, backend)
    metrics, a_tr, c_tr, pol_tr, cri_tr = runs["trainer"]
    ref_out, a_ref, c_ref, pol_ref, cri_ref = runs["reference"]
    steps = ref_out["steps"]
    assert len(a_tr) == len(a_ref) == len(steps) == 4  # 2 epochs x 2 minibatches (3 + 2 episodes)
    # the loss terms, averaged over the minibatches as the trainer reports them
    for key, term in (("ppo/loss", "ppo"), ("actor/entropy", "entropy"), ("value/loss", "value"), ("opd/loss", "opd")):
        vals = [s[term] for s in steps if s[term] is not None]
        if term == "opd" and method == "ppo":
            assert key not in metrics and not vals
            continue
        want = sum(vals) / len(vals)
        assert metrics[key] == pytest.approx(want, rel=RTOL, abs=1e-7), key
    # the clipped gradients of every step, policy and critic: relative error of the whole model's
    # gradient (a tensor with a tiny gradient drifts by fp32 noise alone), and no tensor far off
    for name, tr, rf in (("policy", a_tr, a_ref), ("critic", c_tr, c_ref)):
        for step, (gs_tr, gs_ref) in enumerate(zip(tr, rf)):
            assert [g is None for g in gs_tr] == [g is None for g in gs_ref], (name, step)
            flat_tr = torch.cat([g.flatten() for g in gs_tr if g is not None])
            flat_ref = torch.cat([g.flatten() for g in gs_ref if g is not None])
            assert flat_ref.norm() > 0, (name, step)
            assert _rel(flat_tr, flat_ref) <= RTOL, (name, step, _rel(flat_tr, flat_ref))
            for i, (g_tr, g_ref) in enumerate(zip(gs_tr, gs_ref)):
                if g_ref is not None and g_ref.norm() > 0:
                    assert _rel(g_tr, g_ref) <= 10 * RTOL, (name, step, i, _rel(g_tr, g_ref))
    # the weights after the update: the same change (relative to the change itself)
    start_policy, _, start_critic, _ = _models()
    for m_tr, m_ref, m0 in ((pol_tr, pol_ref, start_policy), (cri_tr, cri_ref, start_critic)):
        d_tr = torch.cat([(a - b).flatten() for a, b in zip(m_tr.parameters(), m0.parameters())])
        d_ref = torch.cat([(a - b).flatten() for a, b in zip(m_ref.parameters(), m0.parameters())])
        assert d_ref.norm() > 0 and _rel(d_tr, d_ref) <= 10 * RTOL, _rel(d_tr, d_ref)


def test_the_reference_case_exercises_every_term():
    """The pinned case is not degenerate: the KL penalty, both clippings and the OPD term are active,
    and the teacher selections differ (so a mutation of any of them changes the update)."""
    cfg, runs = _run("memopd", 0.5, "sdpa")
    metrics = runs["trainer"][0]
    scored = runs["reference"][0]["scored"]
    toks = [t for s in scored for t in s["tokens"]]
    assert sum(t["l_old"] > t["l_ref"] for t in toks) > 0 and sum(t["l_old"] < t["l_ref"] for t in toks) > 0
    assert metrics["ppo/clipfrac"] > 0 and metrics["value/clipfrac"] > 0
    assert metrics["opd/loss"] > 0 and metrics["reward/kl_ref"] > 0
    chosen = [t["teacher_logp"] is not None for t in toks]
    assert any(chosen) and not all(chosen)
    calls = {t["call"] for t in toks}
    assert len(calls) > 1
