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
        "manager": "kvstream.adapters.sglang.manager.KVStreamKVManager",
        "sender": "kvstream.adapters.sglang.sender.KVStreamKVSender",
        "receiver": "kvstream.adapters.sglang.receiver.KVStreamKVReceiver",
        "bootstrap_server": "kvstream.adapters.sglang.manager.KVStreamBootstrapServer"}
    assert fake == "sglang.srt.disaggregation.fake.conn.FakeKVSender"  # others untouched
    assert "'kvstream'" in members and "'mooncake'" in members and "'nixl'" in members


def _run(tmp_path: Path, nats_url: str, scenario: str, rooms: list[int], port: int,
         kill_after_first: bool = False, prefill_tp: int = 1, decode_tp: int = 1,
         mla: bool = False, model_dir: Path | None = None,
         draft: bool = False, state: tuple[str, str] = ("", "")
         ) -> tuple[list[dict], list[dict]]:
    """Every rank of a prefill and a decode engine, one process each; their reports."""
    cmd = [sys.executable, "-m", "tests.with_sglang.sgl_worker"]
    roomlist = ",".join(map(str, rooms))
    procs: dict[tuple[str, int], subprocess.Popen] = {}
    outs: dict[tuple[str, int], Path] = {}
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        for rank in range(tp):
            out = outs[role, rank] = tmp_path / f"{scenario}-{role}{rank}.json"
            extra = ["--rank", str(rank), "--tp", str(tp)] + (["--mla"] if mla else []) + (
                ["--draft"] if draft else []) + (
                ["--state", state[role == "decode"]] if state[role == "decode"] else []) + (
                ["--model-dir", str(model_dir)] if model_dir is not None else [])
            procs[role, rank] = subprocess.Popen(
                [*cmd, role, scenario, str(port), roomlist, str(out), *extra],
                env=_env(nats_url), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        if kill_after_first:
            end = time.monotonic() + 120
            while not outs["prefill", 0].exists() and time.monotonic() < end:
                time.sleep(0.1)
            procs["prefill", 0].send_signal(signal.SIGKILL)
        for (role, rank), proc in procs.items():
            if role == "prefill" and kill_after_first:
                continue
            rc = proc.wait(timeout=240)
            assert rc == 0, (role, rank, proc.stderr.read()[-4000:] if proc.stderr else rc)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ([json.loads(outs["prefill", r].read_text()) for r in range(prefill_tp)],
            [json.loads(outs["decode", r].read_text()) for r in range(decode_tp)])


@pytest.fixture(scope="module")
def nats_url():
    with EmbeddedNats() as nats:
        yield nats.url


def test_pages_and_aux_row_arrive_in_sglang_order(tmp_path, nats_url):
    rooms = [2**63 - 17, 9_000_001]  # SGLang draws rooms below 2**63
    (pre,), (dec,) = _run(tmp_path, nats_url, "ok", rooms, 18998)
    assert dec["classes"] == ["kvstream.adapters.sglang.manager.KVStreamKVManager"]
    page_bytes = 16 * 2 * 16 * 2  # a page of one buffer: 16 tokens x 2 heads x 16 fp16
    for room in rooms:
        first, final, nbytes = pre["polls"][str(room)]
        assert (first, final) == (WAITING, SUCCESS), pre
        assert nbytes == 5 * page_bytes * 2 * 3, pre  # 5 pages of K and V of 3 layers
        got, exact, aux, _ = dec["polls"][str(room)]
        assert got == SUCCESS and exact, dec
        assert aux == [room % 1000, 11, room], dec  # the aux row, its room last


def test_speculative_draft_kv_moves_with_the_pages(tmp_path, nats_url):
    """SGLang appends a draft model's K/V buffers to the target's (same page ids): they
    move byte for byte with them, the one-layer draft's pages checked like the rest."""
    rooms = [6_000_001]
    (pre,), (dec,) = _run(tmp_path, nats_url, "ok", rooms, 19050, draft=True)
    got, exact, aux, _ = dec["polls"][str(rooms[0])]
    assert got == SUCCESS and exact and aux == [1, 11, rooms[0]], dec
    page_bytes = 16 * 2 * 16 * 2
    assert pre["polls"][str(rooms[0])][2] == 5 * page_bytes * 2 * (3 + 1), pre


def test_an_aborted_decode_request_fails_on_both_sides_and_writes_nothing(tmp_path, nats_url):
    rooms = [31, 32]
    (pre,), (dec,) = _run(tmp_path, nats_url, "abort_decode", rooms, 18999)
    for room in rooms:
        assert dec["polls"][str(room)] == [FAILED, True], dec
        # The prefill heard the Drop: its sender fails (while waiting, or at its offer).
        assert FAILED in pre["polls"][str(room)][:2], pre


def test_a_killed_prefill_fails_the_waiting_decode_within_the_peer_timeout(tmp_path,
                                                                           nats_url):
    rooms = [41, 42]
    (pre,), (dec,) = _run(tmp_path, nats_url, "kill", rooms, 19000, kill_after_first=True)
    assert pre["polls"]["41"][:2] == [WAITING, SUCCESS], pre
    assert dec["polls"]["41"][:2] == [SUCCESS, True], dec
    final, exact, _, took = dec["polls"]["42"][:4]
    assert final == FAILED and not exact, dec
    # The registry declares a silent peer dead after peer_timeout_s; the poll sees it then.
    # Margin: 10x for heartbeats and a loaded 2-core machine.
    assert took < PEER_TIMEOUT_S * 10, dec


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 3, "vocab_size": 256, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "torch_dtype": "float16"}  # the worker's 2 KV heads


def _tiny_llama(tmp_path: Path) -> Path:
    """A model folder SGLang's ``ModelConfig`` reads the decode's KV heads from."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    return model


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "mla"), [
    (2, 1, False),  # a gather: the decode rank takes one head from each prefill rank
    (1, 2, False),  # a shared offer: each decode rank pulls its head of the one offer
    (2, 1, True),   # MLA: the latent from prefill rank 0; rank 1 is told it is not read
    (1, 2, True),   # MLA: both decode ranks read rank 0's one offer
])
def test_pages_move_between_engines_of_other_tp_degrees(tmp_path, nats_url, prefill_tp,
                                                        decode_tp, mla):
    """Every decode rank gets every byte of its heads of every page and the aux row; every
    prefill rank succeeds (a rank not read, once it computed). The decode reads its KV
    head count from SGLang's own model config (0.5.23's decode KVArgs carry none)."""
    model = _tiny_llama(tmp_path)
    rooms = [5_000_017, 5_000_018]
    port = 19100 + 10 * prefill_tp + decode_tp + (5 if mla else 0)
    pre, dec = _run(tmp_path, nats_url, "ok", rooms, port, prefill_tp=prefill_tp,
                    decode_tp=decode_tp, mla=mla, model_dir=None if mla else model)
    for rank, report in enumerate(dec):
        assert report["heads"] == ([1, 0] if mla else [2 // decode_tp, 2]), report
        for room in rooms:
            got, exact, aux, _ = report["polls"][str(room)]
            assert got == SUCCESS and exact, (rank, report)
            assert aux == [room % 1000, 11, room], (rank, report)
    for rank, report in enumerate(pre):
        for room in rooms:
            assert report["polls"][str(room)][:2] == [WAITING, SUCCESS], (rank, report)
    if mla and prefill_tp > decode_tp:  # rank 1 was not read: nothing left it
        assert not pre[1]["polls"][str(rooms[0])][2], pre  # no bytes (SGLang: None)


def test_a_want_kept_for_a_request_still_counts_after_its_decode_left(tmp_path, nats_url):
    """MLA, prefill TP 2 to decode TP 1: the decode reads rank 0 and tells rank 1 it is not
    read. Rank 1 builds its last sender only after the decode finished and left; the
    Want it kept for that room (from a live decode when it came) still counts, so rank 1
    succeeds instead of waiting out its bootstrap timeout."""
    rooms = [7_000_001, 7_000_002]
    pre, (dec,) = _run(tmp_path, nats_url, "late", rooms, 19200, prefill_tp=2, mla=True)
    for room in rooms:
        assert dec["polls"][str(room)][:2] == [SUCCESS, True], dec
    assert pre[1]["decode_left"] == 1, pre  # ``until`` returned True: the decode was gone
    for rank in (0, 1):
        for room in rooms:
            assert pre[rank]["polls"][str(room)][:2] == [WAITING, SUCCESS], (rank, pre)


def test_side_state_moves_with_the_pages(tmp_path, nats_url):
    """SGLang's side state (``KVArgs.state_*``): a Mamba component (conv and temporal
    buffers of other item sizes, one slot per request, a layer without state) and block
    scales (one item per page) move item for item into the decode's own slots and pages,
    and the decode succeeds only once they and the pages landed. A decode with side state
    and a prefill without fail on both sides, the prefill saying why."""
    rooms = [8_000_001, 8_000_002]
    (pre,), (dec,) = _run(tmp_path, nats_url, "ok", rooms, 19300, state=("mamba", "mamba"))
    for room in rooms:
        assert pre["polls"][str(room)][:2] == [WAITING, SUCCESS], pre
        got, exact, aux, _ = dec["polls"][str(room)]
        assert got == SUCCESS and exact and aux == [room % 1000, 11, room], dec
        assert dec["state"][str(room)] is True, dec
    assert dec["stray"] is False, dec  # no other slot or page written
    (tmp_path / "mixed").mkdir()
    (pre,), (dec,) = _run(tmp_path / "mixed", nats_url, "ok", rooms[:1], 19301,
                          state=("", "mamba"))
    assert dec["polls"][str(rooms[0])][:2] == [FAILED, False], dec
    assert pre["polls"][str(rooms[0])][:2] == ["bootstrap", FAILED], pre
    assert "side state ['mamba', 'block_scale'] at the decode" in pre["polls"][str(rooms[0])][2]
    # The decode hears the prefill's Drop, or sees it leave first (it exits right after).


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "mla", "state"), [
    (2, 1, False, "swa"),  # SWA pages: a gather of heads, as the main pages move
    (1, 2, False, "swa"),  # SWA pages: each decode rank its heads of rank 0's one offer
    (2, 1, True, "dsa"),   # MLA: the indexer pages whole from prefill rank 0 (rank 1, not
                           # read, holds other bytes: the check proves which rank was read)
    (1, 2, True, "dsa"),   # MLA: both decode ranks read rank 0's one offer of them
])
def test_side_state_moves_between_engines_of_other_tp_degrees(tmp_path, nats_url, prefill_tp,
                                                              decode_tp, mla, state):
    """An MHA model's SWA sub-pool is split by KV heads like its pages: every decode rank
    gets its heads of the window's pages; an MLA model's side state is the same on every
    rank: each decode rank gets it whole from the rank its latent comes from. Byte for
    byte, and Success only once pages, side state and aux row landed."""
    model = _tiny_llama(tmp_path)
    rooms = [8_100_001, 8_100_002]
    port = 19400 + 10 * prefill_tp + decode_tp + (5 if mla else 0)
    pre, dec = _run(tmp_path, nats_url, "ok", rooms, port, prefill_tp=prefill_tp,
                    decode_tp=decode_tp, mla=mla, model_dir=None if mla else model,
                    state=(state, state))
    for rank, report in enumerate(dec):
        for room in rooms:
            got, exact, aux, _ = report["polls"][str(room)]
            assert got == SUCCESS and exact and aux == [room % 1000, 11, room], (rank, report)
            assert report["state"][str(room)] is True, (rank, report)
        assert report["stray"] is False, (rank, report)  # nothing landed elsewhere
    for rank, report in enumerate(pre):
        for room in rooms:
            assert report["polls"][str(room)][:2] == [WAITING, SUCCESS], (rank, report)


def test_side_state_of_unknown_split_is_refused_between_other_tp_degrees(tmp_path, nats_url):
    """Mamba state (SGLang slices it by heads and channels) and an MHA model's block
    scales are a rank's own bytes: between TP 2 and 1 the decode refuses before a byte
    moves, naming them, and every prefill rank fails too (told, not waiting out its
    bootstrap timeout)."""
    model = _tiny_llama(tmp_path)
    rooms = [8_200_001]
    pre, (dec,) = _run(tmp_path, nats_url, "ok", rooms, 19450, prefill_tp=2,
                       model_dir=model, state=("mamba", "mamba"))
    got, exact, _, _, why = dec["polls"][str(rooms[0])]
    assert (got, exact) == (FAILED, False), dec
    assert "side state ['block_scale', 'mamba'] moves only between equal TP degrees" in why
    for rank, report in enumerate(pre):
        assert report["polls"][str(rooms[0])][:2] == ["bootstrap", FAILED], (rank, report)
