"""The baseline: the same bytes moved with plain ucxx calls, in its fastest configuration.

"Coalesced per layer": the sender gathers each layer's scattered blocks into a
buffer and sends it as one tagged message; the receiver posts every layer's
receive up front (into full-size buffers, no window), scatters each as it
lands. ``wire=True`` drops gather and scatter: contiguous buffers both ends,
the pure transport figure. Worker-address endpoints, no error handling: the
configuration PERF.md found fastest.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from kvstream.dataplane.ucx import as_ucx_buffer

if TYPE_CHECKING:
    from kvstream.memory import BlockMap, RegisteredKV

__all__ = ["RAW_TAG_BASE", "raw_receive", "raw_send"]

RAW_TAG_BASE = 0xFFFF0000 << 32


def _buffers(mem: RegisteredKV, blocks: BlockMap) -> list[Any]:
    import torch

    nbytes = mem.planes * mem.plane_bytes(len(blocks))
    bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(mem.layout.num_layers)]
    for b in bufs:
        b.fill_(1)  # fault the pages in before the clock starts
    return bufs


async def raw_receive(mem: RegisteredKV, blocks: BlockMap, run: int, *, wire: bool,
                      ready: Any) -> float:
    """Receive one cache; returns the monotonic time the last layer was in place."""
    import ucxx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    worker = ucxx.core._get_ctx().worker
    bufs = _buffers(mem, blocks)
    base = RAW_TAG_BASE + (run << 8)
    reqs = [worker.tag_recv(Array(as_ucx_buffer(b)), Tag(base + i)) for i, b in enumerate(bufs)]
    ready()
    for layer, req in enumerate(reqs):
        await req.wait()
        if not wire:
            view = mem.staging_view(bufs[layer], len(blocks))
            await anyio.to_thread.run_sync(mem.scatter, layer, blocks, view)
    return time.monotonic()


async def raw_send(mem: RegisteredKV, blocks: BlockMap, run: int, peer_address: bytes, *,
                   wire: bool) -> float:
    """Send one cache; returns the monotonic start time."""
    import ucxx

    ep = await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(peer_address), endpoint_error_handling=False)
    bufs = _buffers(mem, blocks)
    base = RAW_TAG_BASE + (run << 8)
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        for layer, buf in enumerate(bufs):
            if not wire:
                view = mem.staging_view(buf, len(blocks))
                await anyio.to_thread.run_sync(mem.gather, layer, blocks, view)
            tg.start_soon(ep.send, as_ucx_buffer(buf), base + layer, True)
    return t0
