"""The controlled study's decision rules (docs/study.md): which model enters a design, each written before the
run it decides and checked here from that run's evaluations."""
