"""Evaluation of a model on benchmarks (the aggregates of Tables 1-2), the RCE of real rollouts, and the
benchmark of the prefill paths on evaluation episodes."""
