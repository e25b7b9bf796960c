"""The entry point `memopd study design` had as a script (docs/study.md and docs/results.md quote its commands):
the same arguments, the same output (memopd.study.design)."""
import sys

from memopd.cli import main

if __name__ == "__main__":
    main(["study", "design", *sys.argv[1:]])
