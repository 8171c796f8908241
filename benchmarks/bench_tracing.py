"""The same transfers with tracing on (every span exported to a file) and off, one run.

    python benchmarks/bench_tracing.py --json --repeat 3
"""

from kvstream.tools.cli import main

if __name__ == "__main__":
    import sys

    main(["bench", "--tracing", *sys.argv[1:]])
