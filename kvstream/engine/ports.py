"""Opening the agent's two ports when it was not handed them: NATS and UCX.

The only place the engine names its production implementations; everything else sees
``ControlPort`` and ``Transport``, so a test can pass in-memory ones instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from kvstream.control.nats_server import DEFAULT_NATS_URL, EmbeddedNats, is_listening
from kvstream.control.subjects import Subjects

if TYPE_CHECKING:
    from kvstream.config import AgentConfig
    from kvstream.control.port import ControlPort
    from kvstream.dataplane.tcp import TcpTransport
    from kvstream.dataplane.transport import Transport

__all__ = ["open_control", "open_tcp", "open_transport"]


async def _shielded(close: Callable[[], Awaitable[None]], timeout: float = 5.0) -> None:
    """Run a release step even when the owner is being cancelled, bounded in time."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
        await close()


async def open_control(cfg: AgentConfig, stack: contextlib.AsyncExitStack
                       ) -> tuple[ControlPort, str]:
    """Connect to ``cfg.nats_url`` (default: a local server, embedded if none listens);
    returns the port and the URL it reached."""
    from kvstream.control.bus import ControlBus

    url = cfg.nats_url
    if url is None:
        url = DEFAULT_NATS_URL
        if not is_listening(url):
            nats = EmbeddedNats(port=4222).start()
            stack.callback(nats.stop)
    bus = await ControlBus.connect(url, name=f"kvstream-{cfg.instance_id}", auth=cfg.nats_auth,
                                   inbox_prefix=Subjects(cfg.namespace).inbox(cfg.instance_id))
    stack.push_async_callback(_shielded, bus.close)
    return bus, url


async def open_transport(cfg: AgentConfig, stack: contextlib.AsyncExitStack, *,
                         cuda_device: int | None = None) -> Transport:
    """The UCX worker; ``cuda_device``: the registered KV's GPU, current on UCX's progress
    thread (ucxx makes GPU 0 current there, a context on GPU 0 for every TP rank)."""
    from kvstream.dataplane.ucx import UcxWorker

    worker = await UcxWorker.open(progress_mode=cfg.progress_mode,
                                  error_handling=cfg.ucx_error_handling,
                                  cuda_device=cuda_device)
    stack.push_async_callback(_shielded, worker.close)
    return worker


def _route_to(url: str) -> str:
    """The local IP that reaches ``url``'s host (no packet is sent): what a peer that
    reaches the same NATS server is likely to reach us on."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


async def open_tcp(cfg: AgentConfig, stack: contextlib.AsyncExitStack,
                   nats_url: str) -> TcpTransport | None:
    """kvstream's TCP data path (None when the config leaves it out)."""
    if "tcp" not in cfg.paths or cfg.tcp_listen == "off":
        return None
    from kvstream.dataplane.tcp import TcpTransport

    host, port, advertise = "0.0.0.0", 0, None
    if cfg.tcp_listen:
        host, _, port_text = cfg.tcp_listen.rpartition(":")
        host, port = host.strip("[]"), int(port_text)
    if host in ("0.0.0.0", "::"):
        advertise = _route_to(nats_url)
    tcp = await TcpTransport.open(host, port, advertise=advertise, lanes=cfg.tcp_lanes)
    stack.push_async_callback(_shielded, tcp.close)
    return tcp
