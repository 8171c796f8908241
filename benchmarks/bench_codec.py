"""The 8-bit wire codecs (fp8_e4m3, int8) against verbatim in one run, and each CPU codec
against the naive torch path.

    python benchmarks/bench_codec.py --json --transport tcp --repeat 3   # a slow link
    python benchmarks/bench_codec.py --json --repeat 3 --layer-compute-ms 5
    python benchmarks/bench_codec.py --accuracy                          # error, attention
"""

from kvstream.tools.cli import main

if __name__ == "__main__":
    import sys

    main(["bench", "--codec", "fp8_e4m3", "--codec", "int8", *sys.argv[1:]])
