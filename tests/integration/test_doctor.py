"""kvstream doctor against the real thing: a real nats-server, real UCX in two processes.

Each run costs about 4-6 s here (torch's import, two processes starting ucxx, and ucxx's
notifier thread, which stops within a second), so there are three.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import msgspec
from click.testing import CliRunner

from kvstream.doctor import STATUSES, DoctorReport, doctor, format_report, run_checks
from kvstream.doctor.ucx_log import KNOWN_TRANSPORTS, SHM_TRANSPORTS

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def test_json_against_a_real_server(nats_server):
    # A real process, so that stdout is the file descriptor: UCX's C-level output would
    # land there too if it leaked.
    code = "from kvstream.doctor import doctor; doctor()"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, "--json", "--nats-url", nats_server.url],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    checks = _checks(report)
    assert all(c["status"] in STATUSES for c in report["checks"])
    assert report["failures"] == 0 and report["warnings"] == sum(
        c["status"] == "warn" for c in report["checks"])

    nats = report["nats"]
    assert checks["nats"]["status"] == "ok" and nats["connected"]
    assert nats["servers"][0]["version"] and nats["servers"][0]["version"] in checks["nats"]["message"]
    assert nats["flush_ms"] > 0

    ucx = report["ucx"]
    assert ucx["error"] == "" and ucx["source"] == "protocol usage"
    host = ucx["host_transports"]
    assert host and all(isinstance(t, str) and _NAME.match(t) and t in KNOWN_TRANSPORTS
                        for t in host), host
    # Shared memory is asserted only where UCX itself lists a shared-memory transport as
    # available on this host (`ucx_info -d`, another UCX mechanism than the usage tables)
    # and nothing restricts UCX: then two local workers must pick one, or the doctor (or
    # the agent's endpoint setup it copies) is wrong.
    offered = set(ucx["available_transports"] or ()) & SHM_TRANSPORTS
    if offered and "UCX_TLS" not in os.environ:
        assert set(host) & SHM_TRANSPORTS, (host, offered)
        assert checks["ucx.host"]["status"] == "ok"

    link = ucx["link"]
    assert checks["link"]["status"] in ("ok", "warn")
    assert link["nbytes"] == 64 << 20 and link["gbps"] > 0 and link["memcpy_gbps"] > 0
    assert len(link["gbps_runs"]) == 3 and set(link["transports"]) <= set(host)
    if _cuda():
        assert checks["ucx.device"]["status"] in ("ok", "warn"), checks["ucx.device"]
    else:
        assert checks["ucx.device"] == {"name": "ucx.device", "status": "skip",
                                        "message": "skipped: no CUDA"}
    assert elapsed < 30


def test_unreachable_nats_fails_at_once():
    # --timeout 5: a refused connection must be known at once, not after the timeout.
    result = CliRunner().invoke(doctor, ["--json", "--nats-url", "nats://127.0.0.1:1",
                                         "--no-link-check", "--timeout", "5"])
    assert result.exit_code == 1, result.output
    report = msgspec.json.decode(result.stdout, type=DoctorReport)
    assert not report.ok and report.failures >= 1
    assert report.nats.cause == "refused" and not report.nats.connected
    assert report.nats.servers[0].cause == "refused"
    assert report.nats.seconds < 1.0
    assert report.ucx.link is None and report.ucx.host_transports  # UCX was still probed

    lines = format_report(report).splitlines()
    assert all(len(line) <= 100 for line in lines)
    (nats_line,) = [line for line in lines if line.split()[1:2] == ["nats"]]
    assert nats_line.startswith("FAIL  nats        nats://127.0.0.1:1: refused")
    assert "`kvstream nats`" in nats_line
    assert "skip  link        skipped (--no-link-check)" in lines
    assert re.fullmatch(r"kvstream doctor: \d+ warnings?, [1-9]\d* failures?", lines[-1])


def test_ucx_tls_tcp_is_seen_and_warned(monkeypatch, nats_server):
    monkeypatch.setenv("UCX_TLS", "tcp")
    report = run_checks(nats_server.url)
    checks = {c.name: c for c in report.checks}
    assert report.ucx.env["UCX_TLS"] == "tcp"
    assert report.ucx.host_transports == ("tcp",)
    assert checks["ucx"].status == "warn" and "UCX_TLS=tcp" in checks["ucx"].message
    assert checks["ucx.host"].status == "warn" and "host memory: tcp;" in checks["ucx.host"].message
    assert report.ucx.link is not None and report.ucx.link.transports == ("tcp",)
    assert report.failures == 0 and report.warnings >= 2
    text = format_report(report)
    assert text.splitlines()[-1] == (f"kvstream doctor: {report.warnings} warnings, 0 failures")
