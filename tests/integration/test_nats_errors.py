"""An unreachable NATS fails at once with its real cause (refused, timed out, auth), and
the CLI says it in one line. Real nats-server processes and real sockets."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import pytest

from kvstream import Agent, AgentConfig, NatsConnectError
from kvstream.control.bus import ControlBus
from kvstream.control.nats_server import find_nats_server, free_port, is_listening
from kvstream.control.reach import probe

pytestmark = pytest.mark.anyio


def _refused_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"  # nothing listens: the kernel answers RST


@pytest.fixture
def silent_url():
    """A TCP listener that never sends NATS's INFO greeting."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        yield f"nats://127.0.0.1:{srv.getsockname()[1]}"


@pytest.fixture
def auth_server():
    port = free_port()
    proc = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port),
                             "--user", "kv", "--pass", "secret"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while not is_listening(url):
        assert time.monotonic() < deadline and proc.poll() is None, "nats-server did not start"
        time.sleep(0.02)
    yield port
    proc.terminate()
    proc.wait(5)


async def _fails(url: str, timeout: float = 5.0) -> tuple[NatsConnectError, float]:
    t0 = time.monotonic()
    with pytest.raises(NatsConnectError) as info:
        await ControlBus.connect(url, name="test", timeout=timeout)
    return info.value, time.monotonic() - t0


async def test_refused_at_once() -> None:
    url = _refused_url()
    err, took = await _fails(url)
    assert err.cause == "refused" and err.url == url
    assert "connection refused" in str(err) and url in str(err)
    assert took < 2.0  # the kernel refuses at once; nats-py's retry loop is cut short


async def test_every_server_of_a_list_refused() -> None:
    url = f"{_refused_url()},{_refused_url()}"
    err, took = await _fails(url)
    assert err.cause == "refused" and took < 2.0


async def test_silent_server_times_out(silent_url: str) -> None:
    err, took = await _fails(silent_url)
    assert err.cause == "timeout" and "timed out" in str(err)
    assert took < 4.0  # connect_timeout is 2 s, and the first attempt is the one that counts


async def test_wrong_credentials_are_named(auth_server: int) -> None:
    err, took = await _fails(f"nats://kv:wrong@127.0.0.1:{auth_server}")
    assert err.cause == "auth" and "authentication failed" in str(err)
    assert took < 3.0  # one refused attempt, and at most one look at the server's greeting
    bus = await ControlBus.connect(f"nats://kv:secret@127.0.0.1:{auth_server}", name="ok")
    await bus.close()


@pytest.fixture
def resetting_url():
    """A server that greets as a NATS server requiring auth, then resets the connection on
    CONNECT: what a real one's '-ERR Authorization Violation' plus close looks like when
    the reset overtakes the error line."""
    import struct
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b'INFO {"server_id":"x","version":"2.10.0","auth_required":true,'
                             b'"max_payload":1048576,"proto":1}\r\n')
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"nats://kv:wrong@127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    thread.join(5)
    srv.close()


async def test_reset_after_greeting_is_named_auth(resetting_url: str) -> None:
    err, took = await _fails(resetting_url)
    assert err.cause == "auth" and "requires credentials" in str(err), str(err)
    assert took < 3.0


async def test_probe_sees_the_server_without_credentials(auth_server: int) -> None:
    (found,) = await probe(f"nats://127.0.0.1:{auth_server}")
    assert found.reachable and found.auth_required and found.version
    (gone,) = await probe(_refused_url())
    assert not gone.reachable and gone.cause == "refused"


async def test_agent_start_fails_with_the_cause() -> None:
    url = _refused_url()
    t0 = time.monotonic()
    with pytest.raises(NatsConnectError, match="connection refused"):
        async with Agent(AgentConfig(instance_id="lonely", nats_url=url)):
            pass
    assert time.monotonic() - t0 < 2.0


def test_cli_says_it_in_one_line() -> None:
    url = _refused_url()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvstream.tools.cli", "demo", "--nats-url", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("kvstream: error:") and "connection refused" in lines[-1], out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 60  # process start-ups, not NATS retries
