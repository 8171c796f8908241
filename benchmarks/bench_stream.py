"""Same as `kvstream bench`: prefill -> decode between two processes, against raw ucxx.

    python benchmarks/bench_stream.py --json --layer-compute-ms 5
"""

from kvstream.tools.cli import main

if __name__ == "__main__":
    import sys

    main(["bench", *sys.argv[1:]])
