"""vLLM's own KV cache events, bridged onto kvstream's (issue 20).

vLLM publishes what its prefix cache stores and evicts (``--kv-events-config`` with the
``zmq`` publisher: topic, an 8-byte sequence number, a MessagePack ``KVEventBatch``). A
connector cannot see evictions itself (vLLM frees blocks without telling it), so the
worker of TP rank 0 subscribes to that socket and turns each event into kvstream's chained
hashes (``kvstream.prefix``: the hashes its transfers and the routers use), published by
its agent (``Agent.kv_events``). vLLM's hashes (its own function, seed and extra keys)
are kept only to map a block's parent and a removal onto kvstream's hash of that block.

Only blocks kvstream's hash describes are bridged: a block with extra keys (LoRA,
multimodal inputs, a cache salt) or of another cache group is not, nor are its
descendants; a gap in vLLM's sequence clears the instance's view (its events lost, the
router sees fewer blocks, never blocks the engine does not hold).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from kvstream.prefix import block_hashes

__all__ = ["EventBridge", "HashBridge", "subscriber_endpoint"]

log = logging.getLogger("kvstream.vllm")

Sink = Callable[[str, list[int]], None]  # ("stored" | "removed" | "cleared", hashes)


class HashBridge:
    """vLLM's events to kvstream hashes (pure): vLLM's hash of each bridged block ->
    kvstream's, at most ``max_blocks`` (the oldest forgotten first)."""

    def __init__(self, block_size: int, *, max_blocks: int = 1 << 20) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self._ours: OrderedDict[Hashable, int] = OrderedDict()
        self.skipped = 0  # stored blocks not bridged (extra keys, another group, no parent)

    def stored(self, event: Any) -> list[int]:
        """kvstream's hashes of the blocks of a ``BlockStored`` that it describes."""
        theirs = list(event.block_hashes)
        size = int(event.block_size)
        tokens = list(event.token_ids)
        extra = list(getattr(event, "extra_keys", None) or [])
        lora = getattr(event, "lora_id", None) is not None or getattr(event, "lora_name", None)
        if size != self.block_size or getattr(event, "group_idx", None) not in (None, 0) or \
                len(tokens) != size * len(theirs) or lora:
            self.skipped += len(theirs)
            return []
        parent = 0
        if event.parent_block_hash is not None:
            known = self._ours.get(event.parent_block_hash)
            if known is None:  # its parent was not bridged: neither is it
                self.skipped += len(theirs)
                return []
            parent = known
        n = next((i for i, e in enumerate(extra) if e), len(theirs))
        self.skipped += len(theirs) - n
        ours = block_hashes(tokens[:n * size], size, parent=parent)
        for h, o in zip(theirs[:n], ours, strict=True):
            self._ours[h] = o
            self._ours.move_to_end(h)
        while len(self._ours) > self.max_blocks:
            self._ours.popitem(last=False)
        return ours

    def removed(self, event: Any) -> list[int]:
        if getattr(event, "group_idx", None) not in (None, 0):
            return []
        out = []
        for h in event.block_hashes:
            ours = self._ours.pop(h, None)
            if ours is not None:
                out.append(ours)
        return out

    def cleared(self) -> None:
        self._ours.clear()

    def apply(self, batch: Any, sink: Sink) -> None:
        """Every event of one ``KVEventBatch``, in order, to ``sink``."""
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored" and getattr(event, "medium", None) in (None, "GPU"):
                if got := self.stored(event):
                    sink("stored", got)
            elif kind == "BlockRemoved" and getattr(event, "medium", None) in (None, "GPU"):
                if got := self.removed(event):
                    sink("removed", got)
            elif kind == "AllBlocksCleared":
                self.cleared()
                sink("cleared", [])


def subscriber_endpoint(endpoint: str, data_parallel_rank: int = 0) -> str:
    """Where to subscribe to a publisher bound at ``endpoint`` on this host (vLLM binds
    ``tcp://*:port``, offset by its DP rank)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    ep = ZmqEventPublisher.offset_endpoint_port(endpoint, data_parallel_rank) or endpoint
    return ep.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")


class EventBridge:
    """A thread subscribed to vLLM's event socket, feeding ``sink`` (which must be safe to
    call from it: the connector hops onto the agent's loop)."""

    def __init__(self, endpoint: str, topic: str, block_size: int, sink: Sink) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint, self.hashes, self.sink = endpoint, HashBridge(block_size), sink
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._seq: int | None = None
        self.batches = self.gaps = self.malformed = 0
        self._thread = threading.Thread(target=self._run, name="kvstream-kv-events",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                frames = self._sub.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return  # closed
            try:
                self._handle(frames)
            except Exception:  # the bridge's bug must not end the engine
                log.exception("kvstream: bridging a KV events batch failed: clearing this "
                              "instance's view")
                self.hashes.cleared()  # what the batch said is unknown: as after a gap
                with contextlib.suppress(Exception):
                    self.sink("cleared", [])

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = self._decoder.decode(frames[2])
        except Exception:
            self.malformed += 1
            return
        if self._seq is not None and seq != self._seq + 1:
            # Missed batches (a slow subscriber past vLLM's high-water mark): what they said
            # is unknown, so say nothing is held and go on from here.
            self.gaps += 1
            log.warning("kvstream: vLLM KV events %d..%d missed: clearing this instance's view",
                        self._seq + 1, seq - 1)
            self.hashes.cleared()
            self.sink("cleared", [])
        self._seq = seq
        self.batches += 1
        self.hashes.apply(batch, self.sink)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sub.close(linger=0)
