"""benchmarks/peers: the knob arithmetic and run.py's summary, without NIXL, ucxx or torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstream.bench.synthetic import BenchSpec, pick_blocks
from kvstream.layout import KVLayout

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, PEERS / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


run = _load("peers_run", "run.py")  # puts benchmarks/peers on sys.path for `workload`
wl = sys.modules["workload"]


def _flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""], strict=True) if a.startswith("--")}


def test_default_knobs_are_kvstream_bench_defaults():
    args = wl.kvstream_layout_args(wl.Workload())
    assert _flags(args) == {"--layers": "32", "--kv-heads": "8", "--head-dim": "128",
                            "--block-size": "16", "--dtype": "float16", "--tokens": "4096"}


@pytest.mark.parametrize(("block_bytes", "heads", "block_size"),
                         [(65536, 8, 16), (4096, 8, 1), (2**20, 8, 256), (2048, 4, 1),
                          (1024, 2, 1), (1536, 1, 3), (512, 1, 1)])
def test_block_bytes_to_layout(block_bytes, heads, block_size):
    w = wl.Workload(block_bytes=block_bytes, blocks_per_layer=10, layers=3, scattered=False)
    f = _flags(wl.kvstream_layout_args(w))
    assert (int(f["--kv-heads"]), int(f["--block-size"])) == (heads, block_size)
    assert int(f["--tokens"]) == 10 * block_size and f["--layers"] == "3"
    assert "--contiguous" in f
    # The layout kvstream bench builds from these has exactly our block.
    lay = KVLayout(num_layers=3, num_kv_heads=heads, head_dim=int(f["--head-dim"]),
                   block_size=block_size, dtype="float16")
    assert lay.block_bytes == block_bytes and lay.chunk_bytes == w.chunk_bytes
    assert lay.blocks_for_tokens(int(f["--tokens"])) == 10


@pytest.mark.parametrize("knobs", [{"block_bytes": 1000}, {"block_bytes": 4000},
                                   {"block_bytes": 0}, {"blocks_per_layer": 0},
                                   {"layers": -1}])
def test_impossible_knobs_are_refused(knobs):
    with pytest.raises(wl.KnobError):
        wl.kvstream_layout_args(wl.Workload(**knobs))


def test_refusal_says_what_fits(capsys):
    assert run.main(["--block-bytes", "4000"]) == 2  # before anything runs
    err = capsys.readouterr().err
    assert "4000" in err and "multiple of 512" in err


@pytest.mark.parametrize("scattered", [True, False])
def test_peers_move_kvstream_bench_blocks(scattered):
    w = wl.Workload(block_bytes=65536, blocks_per_layer=256, layers=32, scattered=scattered,
                    seed=3)
    f = _flags(wl.kvstream_layout_args(w))
    spec = BenchSpec(layout=KVLayout(num_layers=32, num_kv_heads=int(f["--kv-heads"]),
                                     head_dim=128, block_size=int(f["--block-size"])),
                     tokens=int(f["--tokens"]), scattered=scattered, seed=3)
    assert w.src_ids == pick_blocks(spec, salt=1) and w.dst_ids == pick_blocks(spec, salt=2)
    assert w.cache_blocks == spec.num_cache_blocks and w.payload_bytes == spec.payload_bytes
    assert w.descriptors == 32 * 2 * 256
    assert w.chunk_index(1, 1, 5) == (1 * 2 + 1) * 512 + 5


def test_kvstream_command():
    w = wl.Workload()
    cmd = run.kvstream_command("py", w, ["--transport", "tcp"])
    assert cmd[:8] == ["py", "-m", "kvstream.tools.cli", "bench", "--json", "--repeat", "1",
                       "--layers"]
    assert cmd[-6:] == ["--mode", "push-pipelined", "--mode", "pull-eager", "--transport", "tcp"]
    theirs = run.kvstream_command("py", w, ["--mode=push-eager"])
    assert theirs[-1] == "--mode=push-eager" and "pull-eager" not in theirs


def _round(kv: float, pull: float, read: tuple[float, float], ucxx: float, memcpy: float,
           verified: bool = True) -> dict:
    """One round's systems' JSON as the peers print it (abridged)."""
    settings = {f"progress_thread_{pt}": {
        "read": {"gbps": r, "verified": True}, "write": {"gbps": r / 2, "verified": True},
        "read_per_layer": {"gbps": r / 4, "verified": True},
        "write_per_layer": {"gbps": r / 4, "verified": True}}
        for pt, r in zip(("off", "on"), read, strict=True)}
    return {
        "kvstream": {"verified": verified, "kvstream_gbps": kv, "ucx_gbps": 1.5,
                     "memcpy_gbps": 9.0, "modes": {
                         "push-pipelined": {"gbps": kv, "verified": verified},
                         "pull-eager": {"gbps": pull, "verified": True}}},
        "nixl": {"settings": settings},
        "ucxx": {"gbps": ucxx, "verified": True, "wire_gbps": 4.0},
        "memcpy": {"variants": {
            "gather": {"gbps": memcpy, "verified": True},
            "memmove": {"gbps": memcpy * 0.8, "verified": True},
            "gather_scatter": {"gbps": memcpy / 2, "verified": True},
            "contiguous": {"gbps": memcpy * 2, "verified": True}}},
    }


def test_summary_and_ratios_from_sample_numbers():
    rounds = [_round(2.0, 1.0, (4.0, 1.0), 2.0, 10.0),
              _round(3.0, 1.5, (2.0, 3.0), 1.0, 12.0),
              _round(2.5, 2.0, (3.0, 2.0), 4.0, 8.0)]
    rows = [run.round_rows(r) for r in rounds]
    assert rows[0]["nixl.read.pt_off"] == (4.0, True)
    assert rows[0]["nixl.write_per_layer.pt_on"] == (0.25, True)
    assert rows[0]["ucxx.in_bench"] == (1.5, True) and rows[0]["memcpy.in_bench"][0] == 9.0
    s = run.summarize(rows)
    assert s["kvstream.push-pipelined"] == {"runs": [2.0, 3.0, 2.5], "median": 2.5,
                                            "best": 3.0, "verified": True}
    # NIXL READ: off has median 3.0 (best 4.0), on median 2.0 (best 3.0): off is chosen.
    assert run.nixl_choice(s, "read") == "nixl.read.pt_off"
    assert run.nixl_choice(s, "write") == "nixl.write.pt_off"
    r = run.ratios(s)
    assert r["kvstream/NIXL-READ"] == {"median": round(2.5 / 3.0, 3), "best": 0.75,
                                       "of": ["kvstream.push-pipelined", "nixl.read.pt_off"]}
    assert r["kvstream/NIXL-WRITE"]["median"] == round(2.5 / 1.5, 3)
    assert r["kvstream/memcpy"] == {"median": 0.25, "best": 0.25,
                                    "of": ["kvstream.push-pipelined", "memcpy.gather"]}
    assert r["kvstream/memcpy-contiguous"]["median"] == 0.125
    assert r["kvstream/ucxx"]["median"] == 1.25 and r["kvstream/ucxx"]["best"] == 0.75
    assert r["kvstream pull-eager/NIXL-READ"]["median"] == 0.5
    text = run.format_report(wl.Workload(), s, r, ["a note"])
    assert "NIXL READ, one request, progress thread off *" in text
    assert "memcpy gather (index_select), 1 thread *" in text
    assert "0.83" in text and "note: a note" in text and "NOT VERIFIED" not in text
    assert text.index("kvstream push-pipelined") < text.index("NIXL") < text.index("memcpy")


def test_the_fastest_variant_is_the_number():
    rounds = [_round(2.0, 1.0, (1.0, 1.0), 2.0, 10.0)]
    rounds[0]["nixl"]["settings"]["progress_thread_on"]["read_per_layer"]["gbps"] = 5.0
    rounds[0]["memcpy"]["variants"]["memmove"]["gbps"] = 16.0
    s = run.summarize([run.round_rows(r) for r in rounds])
    assert run.nixl_choice(s, "read") == "nixl.read_per_layer.pt_on"
    r = run.ratios(s)
    assert r["kvstream/NIXL-READ"]["median"] == 0.4
    # memcpy's number is a one-copy form of the scattered blocks, never the contiguous copy
    assert r["kvstream/memcpy"] == {"median": 0.125, "best": 0.125,
                                    "of": ["kvstream.push-pipelined", "memcpy.memmove"]}


def test_missing_and_failed_systems():
    a = _round(2.0, 1.0, (4.0, 1.0), 2.0, 10.0, verified=False)
    del a["nixl"]
    b = _round(3.0, 1.0, (4.0, 1.0), 2.0, 10.0)
    del b["nixl"]
    b["ucxx"] = {"error": "exit status 1"}
    s = run.summarize([run.round_rows(a), run.round_rows(b)])
    assert s["ucxx.coalesced"]["runs"] == [2.0, None] and s["ucxx.coalesced"]["median"] == 2.0
    assert not s["kvstream.push-pipelined"]["verified"]
    r = run.ratios(s)
    assert r["kvstream/NIXL-READ"]["median"] is None
    text = run.format_report(wl.Workload(), s, r)
    assert "NOT VERIFIED" in text and "(not measured)" in text and "  -  " in text


def test_run_py_imports_light():
    code = (f"import sys; sys.path.insert(0, {str(PEERS)!r}); import run; "
            "print(sorted(m for m in ('torch', 'ucxx', 'nixl', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_report_of_a_saved_run(tmp_path, capsys):
    doc = {"workload": {"block_bytes": 65536, "blocks_per_layer": 256, "layers": 32,
                        "scattered": True, "seed": 0},
           "rounds": [{"results": _round(2.0, 1.0, (4.0, 1.0), 2.0, 10.0)}],
           "notes": ["saved note"], "date": "2026-12-01 19:35 UTC", "revision": "abc",
           "command": "python benchmarks/peers/run.py", "verified": True}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    assert run.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kvstream/NIXL-READ              0.50" in out and "saved note" in out
    assert "kvstream at abc: python benchmarks/peers/run.py" in out
