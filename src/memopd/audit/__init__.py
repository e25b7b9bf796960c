"""Audits of packed representations (alignment, corruption, action domain, packing benchmark)."""
