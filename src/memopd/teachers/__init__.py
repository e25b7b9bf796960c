"""The teachers that play SFT trajectories: the scripted teacher, an LLM teacher served by vLLM, and the
sharded, resumable trajectory step that runs either."""
