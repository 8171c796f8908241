"""kvstream as SGLang's transfer backend (issue 19), against sglang 0.5.23's own code.

The plugin, in a fresh process: SGLang's own ``load_plugins`` finds kvstream's entry point,
its argument parser accepts ``--disaggregation-transfer-backend kvstream``, its class lookup
returns kvstream's classes, and every other backend still resolves to SGLang's own.

SGLang's scheduler order, in two processes over a real nats-server and UCX
(``sgl_worker.py``): every page and the aux row arrive byte for byte and ``Success`` comes
only once the aux row landed; an aborted decode request fails on both sides with nothing
written; a killed prefill fails the decode's waiting request within the peer timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.disaggregation.base.conn",
                    reason="needs SGLang: bash .ci/sglang-env && .venv-sglang/bin/python -m "
                           "pytest tests/with_sglang (README)")

from kvstream import EmbeddedNats

ROOT = Path(__file__).resolve().parents[2]
PEER_TIMEOUT_S = 2.0
SUCCESS, FAILED, WAITING = 4, 0, 2

PLUGIN_CHECK = r"""
import argparse
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "prefill",
                        "--disaggregation-transfer-backend", "kvstream"])
assert ns.disaggregation_transfer_backend == "kvstream", ns.disaggregation_transfer_backend
backend = TransferBackend(ns.disaggregation_transfer_backend)
got = {t.value: get_kv_class(backend, t).__module__ + "." + get_kv_class(backend, t).__name__
       for t in KVClassType}
fake = get_kv_class(TransferBackend("fake"), KVClassType.SENDER)
print(got)
print(fake.__module__ + "." + fake.__name__)
print(sorted(m.value for m in TransferBackend))
"""


def _env(nats_url: str = "") -> dict[str, str]:
    env = {**os.environ, "KVSTREAM_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S), "PYTHONPATH": str(ROOT)}
    if nats_url:
        env["KVSTREAM_NATS_URL"] = nats_url
    return env


def test_the_plugin_makes_kvstream_a_backend_choice():
    out = subprocess.run([sys.executable, "-c", PLUGIN_CHECK], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got, fake, members = out.stdout.strip().splitlines()[-3:]
    classes = eval(got)  # a dict literal we printed
    assert classes == {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": "kvstream.adapters.sglang.conn.KVStreamKVManager",
        "sender": "kvstream.adapters.sglang.conn.KVStreamKVSender",
        "receiver": "kvstream.adapters.sglang.conn.KVStreamKVReceiver",
        "bootstrap_server": "kvstream.adapters.sglang.conn.KVStreamBootstrapServer"}
    assert fake == "sglang.srt.disaggregation.fake.conn.FakeKVSender"  # others untouched
    assert "'kvstream'" in members and "'mooncake'" in members and "'nixl'" in members


def _run(tmp_path: Path, nats_url: str, scenario: str, rooms: list[int], port: int,
         kill_after_first: bool = False) -> tuple[dict, dict]:
    out_p, out_d = tmp_path / f"{scenario}-p.json", tmp_path / f"{scenario}-d.json"
    cmd = [sys.executable, "-m", "tests.with_sglang.sgl_worker"]
    roomlist = ",".join(map(str, rooms))
    p = subprocess.Popen([*cmd, "prefill", scenario, str(port), roomlist, str(out_p)],
                         env=_env(nats_url), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    d = subprocess.Popen([*cmd, "decode", scenario, str(port), roomlist, str(out_d)],
                         env=_env(nats_url), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        if kill_after_first:
            end = time.monotonic() + 120
            while not out_p.exists() and time.monotonic() < end:
                time.sleep(0.1)
            p.send_signal(signal.SIGKILL)
        rc_d = d.wait(timeout=240)
        assert rc_d == 0, d.stderr.read()[-4000:] if d.stderr else rc_d
        if not kill_after_first:
            assert p.wait(timeout=60) == 0, p.stderr.read()[-4000:] if p.stderr else ""
    finally:
        for proc in (p, d):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return json.loads(out_p.read_text()), json.loads(out_d.read_text())


@pytest.fixture(scope="module")
def nats_url():
    with EmbeddedNats() as nats:
        yield nats.url


def test_pages_and_aux_row_arrive_in_sglang_order(tmp_path, nats_url):
    rooms = [2**63 - 17, 9_000_001]  # SGLang draws rooms below 2**63
    pre, dec = _run(tmp_path, nats_url, "ok", rooms, 18998)
    assert dec["classes"] == ["kvstream.adapters.sglang.conn.KVStreamKVManager"]
    page_bytes = 16 * 2 * 16 * 2  # a page of one buffer: 16 tokens x 2 heads x 16 fp16
    for room in rooms:
        first, final, nbytes = pre["polls"][str(room)]
        assert (first, final) == (WAITING, SUCCESS), pre
        assert nbytes == 5 * page_bytes * 2 * 3, pre  # 5 pages of K and V of 3 layers
        got, exact, aux, _ = dec["polls"][str(room)]
        assert got == SUCCESS and exact, dec
        assert aux == [room % 1000, 11, room], dec  # the aux row, its room last


def test_an_aborted_decode_request_fails_on_both_sides_and_writes_nothing(tmp_path, nats_url):
    rooms = [31, 32]
    pre, dec = _run(tmp_path, nats_url, "abort_decode", rooms, 18999)
    for room in rooms:
        assert dec["polls"][str(room)] == [FAILED, True], dec
        # The prefill heard the Drop: its sender fails (while waiting, or at its offer).
        assert FAILED in pre["polls"][str(room)][:2], pre


def test_a_killed_prefill_fails_the_waiting_decode_within_the_peer_timeout(tmp_path,
                                                                           nats_url):
    rooms = [41, 42]
    pre, dec = _run(tmp_path, nats_url, "kill", rooms, 19000, kill_after_first=True)
    assert pre["polls"]["41"][:2] == [WAITING, SUCCESS], pre
    assert dec["polls"]["41"][:2] == [SUCCESS, True], dec
    final, exact, _, took = dec["polls"]["42"][:4]
    assert final == FAILED and not exact, dec
    # The registry declares a silent peer dead after peer_timeout_s; the poll sees it then.
    # Margin: 10x for heartbeats and a loaded 2-core machine.
    assert took < PEER_TIMEOUT_S * 10, dec
