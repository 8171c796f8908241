"""TcpTransport between two processes on two "hosts": the namespaces of a veth pair
(``kvstream.bench.netns``, root needed; skipped without it). 64 MiB in 4 MiB messages,
every byte checked, then both namespaces are gone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

from kvstream.bench import netns
from kvstream.dataplane import wire
from kvstream.dataplane.tcp import TcpTransport

pytestmark = pytest.mark.timeout(180)

MESSAGES = 16
MESSAGE_BYTES = 4 << 20
XFER = 0x1E57_0000_7C01
ROOT = Path(__file__).resolve().parents[2]


def _payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, MESSAGE_BYTES, dtype=np.uint8)


def _expected() -> str:
    digest = hashlib.sha256()
    for i in range(MESSAGES):
        digest.update(_payload(i).data)
    return digest.hexdigest()


async def _receive(host: str) -> None:
    """Post every receive, say where to send, wait, print the digest of what landed."""
    t = await TcpTransport.open(host)
    try:
        bufs = [np.zeros(MESSAGE_BYTES, np.uint8) for _ in range(MESSAGES)]
        recvs = [t.post_recv(b, wire.make_tag(XFER, i, wire.KIND_DATA)) for i, b in enumerate(bufs)]
        # The token goes to the sender as the agent's control plane would carry it.
        print("READY", t.address.decode(), t.token_for("send").hex(), flush=True)
        with anyio.fail_after(120):
            for r in recvs:
                await r.wait()
        digest = hashlib.sha256()
        for b in bufs:
            digest.update(b.data)
        print("DONE", digest.hexdigest(), sum(r.nbytes for r in recvs), t.dropped_unread, flush=True)
    finally:
        await t.close()


async def _send(host: str, peer: str, token: str) -> None:
    t = await TcpTransport.open(host)
    t.set_credentials(peer.encode(), "send", bytes.fromhex(token))
    limiter = anyio.Semaphore(4)

    async def one(i: int) -> None:
        async with limiter:
            await t.send(peer.encode(), _payload(i), wire.make_tag(XFER, i, wire.KIND_DATA))

    try:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(MESSAGES):
                    tg.start_soon(one, i)
    finally:
        await t.close()


def _peer_main() -> None:
    """Entry point of the two child processes: ``recv <host>`` or
    ``send <host> <peer> <token hex>``."""
    role, *rest = sys.argv[1:]
    if role == "recv":
        anyio.run(_receive, rest[0])
    else:
        anyio.run(_send, rest[0], rest[1], rest[2])


def _child(name: str, *args: str) -> list[str]:
    code = "from tests.integration.test_tcp_netns import _peer_main; _peer_main()"
    return [*netns.exec_prefix(name), sys.executable, "-c", code, *args]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("rate_gbit", [None, 5.0])
def test_64_mib_between_two_namespaces(rate_gbit):
    if not netns.available():
        pytest.skip("network namespaces unavailable here (needs root and `ip netns`)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with netns.netns_pair(rate_gbit) as pair:
        recv = subprocess.Popen(_child(pair.b.name, "recv", pair.b.address), cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert recv.stdout is not None
            ready = recv.stdout.readline().split()
            assert ready[:1] == ["READY"] and ready[1].startswith(f"tcp:{pair.b.address}:")
            send = subprocess.run(_child(pair.a.name, "send", pair.a.address, *ready[1:3]),
                                  cwd=ROOT, env=env, timeout=150, check=False)
            out, _ = recv.communicate(timeout=150)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        names = (pair.a.name, pair.b.name)
        qdisc = subprocess.run([*netns.exec_prefix(pair.a.name), "tc", "qdisc", "show", "dev",
                                pair.a.device], capture_output=True, text=True, check=True).stdout
        assert ("tbf" in qdisc) == (rate_gbit is not None)
        assert all(name in _namespaces() for name in names)
    assert send.returncode == 0 and recv.returncode == 0
    done = out.split()
    assert done == ["DONE", _expected(), str(MESSAGES * MESSAGE_BYTES), "0"]
    assert not any(name in _namespaces() for name in names)
