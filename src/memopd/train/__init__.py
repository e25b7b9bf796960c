"""PPO / MemOPD training on exact packed states."""
