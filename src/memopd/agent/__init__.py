"""The agent: MEM1 protocol, memory-rewrite rules, the rollout loop (generation engines: memopd.generation)."""
from memopd.agent.memory import Turn, build_input
from memopd.agent.protocol import Action, Task, parse_response
from memopd.agent.rollout import Retriever, rollout
from memopd.config import RULES, AgentConfig, MemoryConfig

__all__ = ["RULES", "MemoryConfig", "Turn", "build_input", "Action", "Task", "parse_response", "AgentConfig",
           "Retriever", "rollout"]
