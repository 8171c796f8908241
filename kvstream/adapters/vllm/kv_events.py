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

The socket's two ends follow vLLM's rule: vLLM binds a wildcard (``tcp://*:5557``) or an
``ipc://`` endpoint and the bridge connects to it; vLLM *connects* to any other address
(``tcp://127.0.0.1:5557``), so the bridge binds that one. A bridge that hears nothing
while vLLM fills blocks says so (``EventsWatch``): routing by prefix would be blind.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import anyio

from kvstream.prefix import block_hashes

if TYPE_CHECKING:
    from kvstream.adapters.runtime import AgentRuntime

__all__ = ["MISSING_AFTER_S", "EventBridge", "EventsWatch", "HashBridge", "publisher_binds",
           "start_bridge", "subscriber"]

log = logging.getLogger("kvstream.vllm")

# vLLM publishes a step's events at the end of that step: a block filled this long ago
# with no batch since means the events do not arrive (a stalled step delays both alike).
MISSING_AFTER_S = 10.0

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


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's zmq publisher binds ``endpoint`` (else it connects to it): a
    wildcard or an ipc/inproc address binds (vLLM 0.32's ``_is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber(endpoint: str, data_parallel_rank: int = 0) -> tuple[str, bool]:
    """Where this host's subscriber meets vLLM's publisher configured at ``endpoint``
    (offset by its DP rank, as vLLM does), and whether it binds there: it connects to what
    vLLM binds, and binds what vLLM connects to."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    ep = ZmqEventPublisher.offset_endpoint_port(endpoint, data_parallel_rank) or endpoint
    if not publisher_binds(ep):
        return ep, True
    return ep.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:"), False


class EventsWatch:
    """Whether vLLM's events arrive (pure; the clock is passed in): ``filled`` counts the
    blocks vLLM's prefix cache stored (each one is a ``BlockStored`` event), ``batch`` notes
    an arrival. "missing" once a block filled ``MISSING_AFTER_S`` ago has had no batch
    after it; "waiting" before anything was filled or heard; "ok" otherwise."""

    def __init__(self, after_s: float = MISSING_AFTER_S) -> None:
        self.after_s = after_s
        self.unheard_since: float | None = None  # the first fill no batch has followed
        self.heard = False

    def filled(self, blocks: int, now: float) -> None:
        if blocks > 0 and self.unheard_since is None:
            self.unheard_since = now

    def batch(self) -> None:
        self.heard = True
        self.unheard_since = None

    def state(self, now: float) -> str:
        if self.unheard_since is not None and now - self.unheard_since >= self.after_s:
            return "missing"
        return "ok" if self.heard else "waiting"


class EventBridge:
    """A thread subscribed to vLLM's event socket, feeding ``sink`` (which must be safe to
    call from it: the connector hops onto the agent's loop)."""

    def __init__(self, endpoint: str, topic: str, block_size: int, sink: Sink, *,
                 bind: bool = False) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint, self.hashes, self.sink = endpoint, HashBridge(block_size), sink
        self.watch = EventsWatch()
        self._lock = threading.Lock()  # the watch: this thread and vLLM's
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.setsockopt(zmq.LINGER, 0)
        try:
            if bind:
                self._sub.bind(endpoint)
            else:
                self._sub.connect(endpoint)
        except zmq.ZMQError:
            self._sub.close(linger=0)
            raise
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
        with self._lock:
            self.watch.batch()
        self.hashes.apply(batch, self.sink)

    def filled(self, blocks: int, now: float) -> None:
        """vLLM's step stored ``blocks`` blocks (called from vLLM's thread)."""
        with self._lock:
            self.watch.filled(blocks, now)

    def state(self, now: float) -> str:
        with self._lock:
            return self.watch.state(now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sub.close(linger=0)


def events_expected(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events the bridge can read: zmq, and a prefix cache to
    report on."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events and cfg.publisher == "zmq"
                and getattr(cache, "enable_prefix_caching", True))


def start_bridge(vllm_config: Any, rt: AgentRuntime, block_size: int,
                 instance: str) -> EventBridge | None:
    """Subscribe to this engine's KV events and publish them through ``rt``'s agent, its
    state announced and logged as it changes ("off" when vLLM publishes none)."""
    if not events_expected(vllm_config):
        log.warning("kvstream agent %s: vLLM publishes no KV cache events (start it with "
                    "--kv-events-config '{\"enable_kv_cache_events\":true,\"publisher\":"
                    "\"zmq\",\"endpoint\":\"ipc:///tmp/<engine>-kv-events\"}' and prefix "
                    "caching on): KV-aware routers are blind to this engine", instance)
        rt.call(_report, rt, "off")
        return None
    cfg = vllm_config.kv_events_config
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    endpoint, bind = subscriber(cfg.endpoint, dp)

    def sink(kind: str, hashes: list[int]) -> None:
        def on_loop() -> None:
            agent = rt.agent
            if agent is None:  # closing
                return
            events = agent.kv_events(block_size)
            if kind == "stored":
                events.stored(hashes)
            elif kind == "removed":
                events.removed(hashes)
            else:
                events.cleared()
        rt.call(on_loop)

    try:
        bridge = EventBridge(endpoint, cfg.topic, block_size, sink, bind=bind)
    except Exception as exc:  # routing is an optimisation: the engine serves without it
        log.warning("kvstream agent %s cannot bridge vLLM's KV events at %s (%r): KV-aware "
                    "routers are blind to this engine", instance, endpoint, exc)
        rt.call(_report, rt, "missing")
        return None
    log.info("kvstream agent %s bridges vLLM's KV events (%s %s)", instance,
             "bound at" if bind else "connected to", endpoint)
    rt.call(_report, rt, "waiting")
    rt.spawn(_watch, rt, bridge, instance)
    return bridge


def _report(rt: AgentRuntime, state: Any) -> None:
    if rt.agent is not None:
        rt.agent.report_kv_events(state)


async def _watch(rt: AgentRuntime, bridge: EventBridge, instance: str) -> None:
    """Announce the events' state when it changes; a WARNING when they go missing."""
    said = "waiting"
    while rt.agent is not None:
        await anyio.sleep(1.0)
        state = bridge.state(time.monotonic())
        if state == said:
            continue
        if state == "missing":
            log.warning("kvstream agent %s: vLLM stored KV blocks %.0f s ago and no KV event "
                        "arrived at %s since: KV-aware routers are blind to this engine "
                        "(check --kv-events-config's endpoint and topic)", instance,
                        bridge.watch.after_s, bridge.endpoint)
        elif said == "missing":
            log.info("kvstream agent %s: vLLM's KV events arrive again", instance)
        said = state
        _report(rt, state)
