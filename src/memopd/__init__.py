"""MemOPD: exact packed states for on-policy distillation of compact-memory agents."""
__version__ = "0.1.0"
