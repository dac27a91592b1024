"""Benchmark every policy side by side: ``python scripts/bench.py [--quick] …`` (same as ``specter bench``)."""

import sys

from specter.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
