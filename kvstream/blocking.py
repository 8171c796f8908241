"""A synchronous face on the sidecar client, for engines whose hot loop is not async
(vLLM's workers are). It runs the async client on a private event-loop thread; the
per-layer checks that matter (``layer_landed``, ``wait_layer`` on a landed layer) read
local state and never cross threads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio.from_thread

from kvstream.client import Client, RemoteReceive, RemoteSend
from kvstream.layout import KVLayout
from kvstream.shm import SharedKV
from kvstream.transfer import TransferResult

__all__ = ["BlockingClient", "BlockingReceive", "BlockingSend"]


class _Blocking:
    def __init__(self, portal: anyio.from_thread.BlockingPortal, handle: Any) -> None:
        self._portal = portal
        self.handle = handle

    @property
    def done(self) -> bool:
        return bool(self.handle.done)

    def result(self) -> TransferResult:
        return self._portal.call(self.handle.result)

    def wait(self) -> TransferResult:
        return self._portal.call(self.handle.wait)

    def abort(self, reason: str = "aborted by the engine") -> TransferResult:
        return self._portal.call(self.handle.abort, reason)


class BlockingReceive(_Blocking):
    handle: RemoteReceive

    def layer_landed(self, layer: int) -> bool:
        return self.handle.landed[layer]

    def wait_layer(self, layer: int) -> None:
        if self.handle.landed[layer]:  # the fast path: no thread hop
            return
        self._portal.call(self.handle.wait_layer, layer)


class BlockingSend(_Blocking):
    handle: RemoteSend

    def layer_ready(self, layer: int) -> None:
        self.handle.layer_ready(layer)  # a direct socket write from this thread (no hop)

    def all_ready(self) -> None:
        self.handle.all_ready()


class BlockingClient:
    """``with BlockingClient(socket_path) as client:`` the sidecar client, synchronously."""

    def __init__(self, socket_path: str, *, timeout: float = 10.0) -> None:
        self._socket_path = socket_path
        self._timeout = timeout
        self._portal_cm: Any = None
        self._client_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._client: Any = None

    def __enter__(self) -> BlockingClient:
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._client_cm = self._portal.wrap_async_context_manager(
                Client.connect(self._socket_path, timeout=self._timeout))
            self._client = self._client_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._client_cm is not None:
                self._client_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def _call(self, fn: Any, *args: Any) -> Any:
        assert self._portal is not None, "use BlockingClient as a context manager"
        return self._portal.call(fn, *args)

    def register_kv(self, layout: KVLayout, layers: SharedKV) -> None:
        self._call(self._client.register_kv, layout, layers)

    def expect(self, request_id: str, blocks: Sequence[int], *, src: str,
               have: Sequence[int] = ()) -> BlockingReceive:
        """Reserve ``blocks`` for ``src``'s push of ``request_id`` (as ``Client.expect``)."""
        assert self._portal is not None

        async def expect() -> RemoteReceive:
            return await self._client.expect(request_id, blocks, src=src, have=have)

        return BlockingReceive(self._portal, self._call(expect))

    def push(self, request_id: str, dst: str, src_blocks: Sequence[int], *,
             dst_blocks: Sequence[int] | None = None, mode: str = "pipelined") -> BlockingSend:
        assert self._portal is not None

        async def push() -> RemoteSend:
            return await self._client.push(request_id, dst, src_blocks, dst_blocks=dst_blocks,
                                           mode=mode)

        return BlockingSend(self._portal, self._portal.call(push))

    def statistics(self) -> dict[str, int]:
        return self._call(self._client.statistics)
