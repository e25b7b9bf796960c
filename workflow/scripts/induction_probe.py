"""The entry point `memopd study probe-induction` had as a script (docs/study.md and docs/results.md quote its commands):
the same arguments, the same output (memopd.study.probes)."""
import sys

from memopd.cli import main

if __name__ == "__main__":
    main(["study", "probe-induction", *sys.argv[1:]])
