"""The CLI's main jobs end to end, small: real NATS, real processes, real UCX."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BENCH_KEYS = {"verified", "kvstream_gbps", "ucx_gbps", "ratio", "exposed_ms_pipelined",
              "exposed_ms_eager", "ucx_wire_gbps", "payload_bytes"}


def _kvstream(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstream.tools.cli", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_bench_json_small(nats_server):
    out = _kvstream("bench", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                    "--tokens", "512", "--repeat", "1", "--layer-compute-ms", "2", "--json",
                    "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert set(result) >= BENCH_KEYS
    assert result["verified"] is True
    assert result["payload_bytes"] == 4 * 32 * 2 * 16 * 2 * 64 * 2
    assert result["kvstream_gbps"] > 0 and result["ucx_gbps"] > 0
    assert result["exposed_ms_pipelined"] > 0 and result["exposed_ms_eager"] > 0


def test_bench_every_mode_json_small(nats_server):
    modes = ["push-eager", "push-pipelined", "pull-eager", "pull-lazy"]
    out = _kvstream("bench", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                    "--tokens", "512", "--repeat", "1", "--layer-compute-ms", "2", "--json",
                    *[a for m in modes for a in ("--mode", m)], "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["verified"] is True
    assert set(result["modes"]) == set(modes)
    for mode in result["modes"].values():
        assert mode["verified"] is True and mode["gbps"] > 0 and mode["exposed_ms"] >= 0
        assert mode["wire_bytes"] == result["payload_bytes"]


def test_bench_prefix_hit_halves_the_wire(nats_server):
    out = _kvstream("bench", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                    "--tokens", "512", "--repeat", "1", "--prefix-hit", "0.5", "--json",
                    "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["verified"] is True  # the whole cache, held half included
    assert result["wire_bytes"] == result["payload_bytes"] // 2


def test_bench_sidecar_json_small(nats_server):
    out = _kvstream("bench", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                    "--tokens", "512", "--repeat", "1", "--sidecar", "--json",
                    "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["sidecar_gbps"] > 0
    assert result["overhead_measured_in"] == "sidecar"
    assert result["layer_ready_us_p50"] is not None and result["wait_layer_us_p99"] is not None
    stats = result["final_stats"]
    assert stats["sidecar_decode"]["bytes_received"] == 2 * result["payload_bytes"]
    assert stats["sidecar_decode"]["transfers_active"] == 0


def test_demo_runs_and_verifies(nats_server):
    out = _kvstream("demo", "--tokens", "256", "--layer-compute-ms", "1",
                    "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "planner on ib-400g" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: moved 32 MiB of KV") and "verified byte for byte" in last
    assert "x raw ucxx" in last and "x memcpy" in last
    # one definition of exposed: the waterfall's (spans) and the table's (the processes'
    # clocks) measure the same interval of the same transfer
    assert "exposed: " in out.stdout and "last layer_ready" in out.stdout
    # folded: 8 groups of 4 layers, every bar inside its frame
    bars = [ln for ln in out.stdout.splitlines() if ln.count("|") >= 2 and " ms" in ln
            and not ln.startswith(("│", "┃"))]
    assert sum(" send " in ln for ln in bars) == 8
    widths = {ln.index("|", ln.index("|") + 1) - ln.index("|") for ln in bars}
    assert widths == {49}, widths


def test_demo_full_waterfall_has_every_layer(nats_server):
    out = _kvstream("demo", "--tokens", "256", "--layer-compute-ms", "1", "--waterfall",
                    "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    for layer in range(32):
        for kind in ("send", "receive", "wait_layer"):
            assert f"L{layer} {kind} " in out.stdout, (layer, kind)


def test_demo_fails_when_verification_fails(nats_server):
    out = _kvstream("demo", "--tokens", "256", "--layer-compute-ms", "1", "--fault", "corrupt",
                    "--nats-url", nats_server.url)
    assert out.returncode == 1, out.stdout[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL:") and "differ" in last


def test_bench_bad_argument_is_one_line():
    out = _kvstream("bench", "--tokens", "-5")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("kvstream: error:") and "\n" not in out.stderr.strip()


def test_bench_8bit_codecs_over_tcp_pull(nats_server):
    """FP8 and int8 against verbatim in one run, pulled over UCX's TCP transport."""
    out = _kvstream("bench", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                    "--tokens", "512", "--repeat", "1", "--layer-compute-ms", "2", "--json",
                    "--codec", "fp8_e4m3", "--codec", "int8", "--transport", "tcp",
                    "--mode", "pull-eager", "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["transport"] == "tcp"
    none = result["codecs"]["none"]
    assert none["wire_bytes"] == result["payload_bytes"]
    scales = 4 * 2 * 32 * 2 * 4  # layers x K/V x blocks x heads x float32
    for codec in ("fp8_e4m3", "int8"):
        got = result["codecs"][codec]
        assert got["wire_bytes"] == result["payload_bytes"] // 2 + scales
        assert got["verified"] and got["exposed_ms"] >= 0 and got["speedup"] > 0
        speed = result["codec_speed"][codec]
        assert speed["backend"] == "cpu" and speed["quantize_gbps"] > 0
        assert speed["naive_dequantize_gbps"] > 0


@pytest.mark.timeout(600)  # the first run on a machine trains the test transformer (~30 s)
def test_bench_accuracy_report():
    out = _kvstream("bench", "--accuracy", "--json", timeout=540)  # both 8-bit codecs
    assert out.returncode == 0, out.stderr[-2000:]
    reports = json.loads(out.stdout)["accuracy"]
    for codec in ("fp8_e4m3", "int8"):
        rows = [r for r in reports if r["codec"] == codec]
        assert {r["source"] for r in rows} == {"random", "random+outliers", "tiny-llama",
                                               "tiny-llama-init0.5"}
        assert all(r["within_bound"] for r in rows)
        assert 0.5 < rows[0]["wire_bytes"] / rows[0]["raw_bytes"] < 0.51
    llama = {r["codec"]: r for r in reports if r["source"] == "tiny-llama"}
    assert llama["int8"]["attn_cosine_mean"] >= 0.999


def test_bench_tracing_on_and_off(nats_server):
    out = _kvstream("bench", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                    "--tokens", "512", "--repeat", "1", "--tracing", "--json",
                    "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["verified"] is True
    assert result["tracing_gbps"] > 0 and result["tracing_ratio"] > 0
    # warm-up + 1 round; each transfer: 2 transfer spans, the manifest exchange, and a span
    # per frame on each side (this short transfer is one frame: whole_frame_bytes)
    assert result["traced_spans"] == 2 * (3 + 2 * 1)
