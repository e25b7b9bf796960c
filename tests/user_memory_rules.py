"""Memory rules as a user writes them in their own module (agent.rule: user_memory_rules:two_thinks), and two that
break the contract."""
from memopd.agent.memory import Context
from memopd.records import Retained


def two_thinks(prefix, history, cfg):
    """The <think> blocks of the last two calls, oldest first, then the newest observation."""
    c = Context(prefix, history)
    for s in range(max(0, len(history) - 2), len(history)):
        c.keep(s, 0, history[s].think_len)
    c.add(history[-1].observation)
    return c.result()


def rewrites_prefix(prefix, history, cfg):
    return [prefix[0] + 1] + prefix[1:] + history[-1].observation, []


def claims_a_copy(prefix, history, cfg):
    """Says the observation is a copy of the last response."""
    obs = history[-1].observation
    return prefix + obs, [Retained(len(history) - 1, 0, len(prefix), len(obs))]
