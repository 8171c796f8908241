"""SGLang's own CPU unit tests of a disaggregation sender, run against its ``fake`` backend
(the baseline) and against kvstream's, in one run.

SGLang's tests live in its source tree, not in its wheel, so they are fetched at test
time from a pinned commit (never committed here): ``KVSTREAM_SGLANG_TESTS`` names a
folder holding them, else they are downloaded once into ``~/.cache/kvstream/
sglang-tests/<commit>/``; without either (no network to GitHub) the tests skip, saying
so. Of SGLang's ~200 disaggregation unit tests, only ``test_fake_kv_sender.py`` builds a
backend through seams another backend can fill (its ``_make_mgr`` / ``_make_sender``); the
rest build Mooncake/NIXL/Common internals with ``object.__new__`` or test scheduler
queues with mocks (docs/architecture.md, "SGLang backend", lists them). Its cases that
apply run unmodified on a kvstream sender whose decode side (a real receiver, in another
process, over a real nats-server) has asked for the request; those that test the
fake's shortcuts are listed below with the reason.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import time
import types
import unittest
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="needs SGLang")

from kvstream import EmbeddedNats

# SGLang's modules warn on import on a CPU-only machine (no CUDA kernels): its code, run here.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

COMMIT = "137b78d68659c686288c1a12e2377a57c60d7702"  # 11/11 pass on sglang 0.5.23's fake
NAME = "test_fake_kv_sender.py"
URL = f"https://raw.githubusercontent.com/sgl-project/sglang/{COMMIT}/test/registered/unit/" \
      f"disaggregation/{NAME}"
CASES = ["test_polls_before_send_stay_waiting_for_input", "test_normal_send_flow",
         "test_zero_page_last_chunk_still_sends", "test_fully_cached_request_concludes",
         "test_send_without_init_or_poll", "test_waiting_timeout_fails_a_stuck_sender",
         "test_poll_does_not_read_the_timeout_off_the_manager",
         "test_queue_and_prefill_time_is_not_charged_to_the_deadline",
         "test_no_timeout_before_init", "test_timeout_is_configurable",
         "test_abort_sets_failed_state"]
# The cases that test the fake's shortcuts, not the contract a backend with a peer keeps.
NOT_FOR_KVSTREAM = {
    "test_normal_send_flow": "Success the moment send() returns, and the fake's has_sent: "
                             "a backend with a peer succeeds once the decode pulled",
    "test_send_without_init_or_poll": "send() before init(): a real backend does not know "
                                      "the page count then and fails the request",
    "test_poll_does_not_read_the_timeout_off_the_manager": "a fake sender on another "
                                                           "backend's manager (SGLang's "
                                                           "warm-up requests)",
}


def _source() -> Path:
    folder = os.environ.get("KVSTREAM_SGLANG_TESTS")
    if folder:
        return Path(folder) / NAME
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "kvstream" / "sglang-tests" / COMMIT / NAME
    if not path.exists():
        try:
            with urllib.request.urlopen(URL, timeout=15) as resp:
                body = resp.read()
        except OSError as exc:
            pytest.skip(f"SGLang's unit tests are not in its wheel and {URL} is out of reach "
                        f"({exc}); put {NAME} of commit {COMMIT} in a folder named by "
                        "KVSTREAM_SGLANG_TESTS to run them")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    return path


@pytest.fixture(scope="module")
def sglang_tests() -> types.ModuleType:
    path = _source()
    if not path.exists():
        pytest.skip(f"{path} does not exist (KVSTREAM_SGLANG_TESTS)")
    spec = importlib.util.spec_from_file_location("sglang_test_fake_kv_sender", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(case: type[unittest.TestCase], name: str) -> unittest.TestResult:
    result = unittest.TestResult()
    case(name).run(result)
    return result


def _failures(result: unittest.TestResult) -> str:
    return "\n".join(text for _, text in result.errors + result.failures)[-3000:]


@pytest.mark.parametrize("name", CASES)
def test_sglang_fake_backend_baseline(sglang_tests, name):
    result = _run(sglang_tests.TestFakeKVSender, name)
    assert result.wasSuccessful(), _failures(result)


@pytest.fixture(scope="module")
def kvstream_side():
    """A kvstream prefill manager in this process and a decode in another (one agent per
    process), on a real nats-server; the decode asks for each room it is given."""
    from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers
    from sglang.srt.plugins import load_plugins

    from kvstream.adapters.sglang.conn import KVStreamKVManager
    from tests.with_sglang.sgl_worker import Model, kv_args, server_args

    load_plugins()
    port, saved, root = 19400, dict(os.environ), Path(__file__).resolve().parents[2]
    with EmbeddedNats() as nats:
        os.environ["KVSTREAM_NATS_URL"] = nats.url
        model = Model(0, 1, False)
        bufs = model.pools()
        meta = MetadataBuffers(64, hidden_size=16, hidden_states_dtype=torch.float32,
                               max_sampling_mask_tokens=16)
        args = kv_args("prefill", bufs, meta, 0, model, heads_told=True)
        prefill = KVStreamKVManager(args, DisaggregationMode.PREFILL,
                                    server_args("prefill", 1, port, None), False)
        asker = subprocess.Popen(
            [sys.executable, "-m", "tests.with_sglang.sgl_worker", "decode", "ask", str(port),
             "0", os.devnull], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": str(root)})
        try:
            assert asker.stdout is not None and asker.stdout.readline().strip() == "ready"
            yield prefill, asker, f"127.0.0.1:{port}", itertools.count(70_000)
        finally:
            if asker.stdin is not None:
                asker.stdin.close()
            try:
                asker.wait(timeout=30)
            finally:
                if asker.poll() is None:
                    asker.kill()
            prefill.teardown()
            os.environ.clear()
            os.environ.update(saved)


def _kvstream_case(base: type[unittest.TestCase], side) -> type[unittest.TestCase]:
    from kvstream.adapters.sglang.conn import KVStreamKVSender

    prefill, asker, addr, rooms = side

    class KVStreamSender(base):  # type: ignore[misc,valid-type]
        def _make_mgr(self):
            return prefill

        def _make_sender(self, mgr=None):
            room = next(rooms)
            asker.stdin.write(f"{room}\n")
            asker.stdin.flush()
            sender = KVStreamKVSender(mgr=prefill if mgr is None else mgr,
                                      bootstrap_addr=addr, bootstrap_room=room)
            self.addCleanup(sender.clear)
            end = time.monotonic() + 30  # the decode's Want arrives over NATS
            while not sender.wants and time.monotonic() < end:
                time.sleep(0.005)
            assert sender.wants, f"room {room}: the decode's Want never arrived"
            return sender

    return KVStreamSender


@pytest.mark.parametrize("name", [c for c in CASES if c not in NOT_FOR_KVSTREAM])
def test_sglang_sender_tests_on_kvstream(sglang_tests, kvstream_side, name):
    result = _run(_kvstream_case(sglang_tests.TestFakeKVSender, kvstream_side), name)
    assert result.wasSuccessful(), _failures(result)


def test_every_case_is_run_or_said_why_not(sglang_tests):
    """A case SGLang adds at this commit would be neither run nor excused: fail."""
    found = sorted(n for n in dir(sglang_tests.TestFakeKVSender) if n.startswith("test_"))
    assert found == sorted(CASES)
    assert set(NOT_FOR_KVSTREAM) < set(CASES)
