"""A router on NATS: it follows every instance's KV events and the registry, and answers
``Route`` requests in the ``ROUTERS`` queue group (several run side by side; one answers
each request).

Its view comes from the namespace's JetStream stream, read from its first kept message:
a router that starts late or restarts rebuilds it (``follow``). Each instance's batches
are numbered; a gap (a batch missing) is repaired by reading that instance's batches
again from the stream, and if the stream lacks them too, by asking the instance to list
its blocks afresh (``KVResync``). Only events signed by the instance they name, on its
own events subject, count; only instances announced with an endpoint are routed to.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import Counter
from typing import Any

import anyio
import msgspec

from kvstream._exceptions import ConfigError, KVStreamError
from kvstream.control import messages as m
from kvstream.control.auth import NatsAuth
from kvstream.control.bus import ControlBus
from kvstream.control.identity import SENDER, SUBJECT, Identity
from kvstream.control.nats_server import DEFAULT_NATS_URL
from kvstream.control.stream import kv_events_stream
from kvstream.control.subjects import Subjects
from kvstream.routing.cost import Candidate, choose
from kvstream.routing.directory import Directory
from kvstream.routing.index import PrefixIndex

__all__ = ["ROUTERS", "Router", "RouterConfig", "RouterStatistics", "decide"]

log = logging.getLogger("kvstream.router")

ROUTERS = "kvs-routers"  # the queue group of the routers of a namespace
MAX_BUFFERED = 4096  # live batches of one instance held while its view is repaired


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = DEFAULT_NATS_URL
    nats_auth: NatsAuth = NatsAuth()
    namespace: str = "default"
    router_id: str = ""  # "" -> "router-<8 hex>"
    peer_timeout_s: float = 2.0  # an instance silent this long is not routed to
    # cost = missing blocks + weight * load * blocks (routing/cost.py), per leg
    prefill_load_weight: float = 0.5
    decode_load_weight: float = 0.5

    def __post_init__(self) -> None:
        Subjects(self.namespace)
        if self.router_id:
            Subjects.check_instance_id(self.router_id)
        if self.peer_timeout_s <= 0:
            raise ConfigError("peer_timeout_s must be positive")
        if min(self.prefill_load_weight, self.decode_load_weight) < 0:
            raise ConfigError("a load weight is not negative")


class RouterStatistics(msgspec.Struct, frozen=True, kw_only=True):
    routed: int  # Route requests answered
    events: int  # KV event batches applied
    gaps: int  # batches that showed a missing one
    repairs: int  # views reread from the stream
    resyncs: int  # instances asked to list their blocks afresh
    refused: int  # batches not applied (unsigned, not their sender's, over the bounds)
    instances: int  # instances with a view


def decide(directory: Directory, index: PrefixIndex, req: m.Route, role: m.LegRole, *,
           load_weight: float, turn: int = 0) -> m.Decision | None:
    """Where ``role``'s leg of ``req`` goes (pure but for the directory's clock)."""
    cands: list[Candidate] = []
    exclude = set(req.exclude)
    for inst in directory.instances(role):
        if inst.url in exclude:
            continue
        anns = [a for a in (directory.registry.announced(i) for i in inst.instance_ids)
                if a is not None]
        size = next((a.layout.block_size for a in anns if a.layout is not None), 0)
        hashes = req.hashes.get(size, []) if size else []
        blocks = len(hashes) if hashes else (-(-req.tokens // size) if size else 0)
        overlap = max((index.overlap(i, hashes) for i in inst.instance_ids), default=0)
        load = max([float(a.requests) for a in anns] + [float(req.inflight.get(inst.url, 0))])
        cands.append(Candidate(url=inst.url, instance_ids=inst.instance_ids, blocks=blocks,
                               overlap=overlap, load=load,
                               kv_used=max((a.kv_used for a in anns), default=0)))
    best = choose(cands, load_weight=load_weight, turn=turn)
    if best is None:
        return None
    c = best.candidate
    return m.Decision(role=role, url=c.url, instance_ids=list(c.instance_ids),
                      overlap=c.overlap, blocks=c.blocks, load=c.load, cost=best.cost,
                      candidates=len(cands))


class Router:
    """``async with Router(config) as router``: following the stream and serving
    ``Route`` once entered. Raises ``NatsConnectError`` if NATS cannot be reached and
    ``ControlPlaneError`` if it has no JetStream."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.router_id = config.router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(config.namespace)
        self.directory = Directory(peer_timeout_s=config.peer_timeout_s)
        self.index = PrefixIndex()
        self._stream = kv_events_stream(self.subjects)
        self._bus: ControlBus | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tg: Any = None
        self._repairing: dict[str, list[m.KVEvents]] = {}
        self._turn: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()

    async def __aenter__(self) -> Router:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()  # not shielded: its task group must exit where entered

    async def _start(self) -> None:
        cfg = self.config
        bus = self._bus = await ControlBus.connect(cfg.nats_url, name=f"kvstream-{self.router_id}",
                                                   auth=cfg.nats_auth)
        self._stack.push_async_callback(bus.close)
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(self._tg.cancel_scope.cancel)
        # Signed like an agent (its resync requests are told apart), and it believes only
        # events and announcements signed by the instance they name.
        registry = self.directory.registry
        bus.seal.identity = Identity(self.router_id)
        bus.seal.trust = registry.bind_key
        bus.seal.registry_prefix = self.subjects.registry_prefix
        await bus.serve(self.subjects.registry_all, self._on_registry)
        await bus.flush()
        await bus.follow(self.subjects.kv_events_all, self._stream, self._on_events)
        await bus.serve(self.subjects.route, self._on_route, queue=ROUTERS)
        await bus.flush()
        log.info("router %s serving %s", self.router_id, self.subjects.route)

    async def _on_registry(self, msg: m.ControlUnion, headers: dict[str, str]) -> None:
        iid = getattr(msg, "instance_id", None)
        if not isinstance(iid, str) or iid != headers.get(SENDER) or \
                headers.get(SUBJECT) != self.subjects.registry_prefix + iid:
            return None
        self.directory.observe(msg)
        return None

    # -- KV events ------------------------------------------------------------------
    def _checked(self, msg: m.ControlUnion, headers: dict[str, str]) -> m.KVEvents | None:
        if not isinstance(msg, m.KVEvents) or msg.instance_id != headers.get(SENDER) or \
                headers.get(SUBJECT) != self.subjects.kv_events(msg.instance_id):
            self._counts["refused"] += 1
            return None
        return msg

    async def _on_events(self, msg: m.ControlUnion, headers: dict[str, str]) -> None:
        batch = self._checked(msg, headers)
        if batch is None:
            return None
        held = self._repairing.get(batch.instance_id)
        if held is not None:  # applied after the reread, in order
            if len(held) < MAX_BUFFERED:
                held.append(batch)
            return None
        self._apply(batch)
        return None

    def _apply(self, batch: m.KVEvents) -> None:
        got = self.index.apply(batch)
        if got == "refused":
            self._counts["refused"] += 1
            return
        if got != "duplicate":
            self._counts["events"] += 1
        if got == "gap" and batch.instance_id not in self._repairing:
            self._counts["gaps"] += 1
            self._repairing[batch.instance_id] = []
            self._tg.start_soon(self._repair, batch.instance_id)

    async def _repair(self, iid: str) -> None:
        """Reread ``iid``'s batches from the stream; still a gap: ask it for a listing."""
        assert self._bus is not None
        self._counts["repairs"] += 1
        try:
            kept = await self._bus.kept(self.subjects.kv_events(iid), self._stream)
        except KVStreamError as exc:
            log.warning("router %s: rereading %s's KV events failed: %s", self.router_id, iid,
                        exc)
            kept = []
        held = self._repairing.pop(iid, [])
        if kept:
            self.index.forget(iid)
            for msg, headers in kept:
                batch = self._checked(msg, headers)
                if batch is not None:
                    self.index.apply(batch)
        for batch in held:
            self.index.apply(batch)
        view = self.index.view(iid)
        if view is not None and view.stale:
            self._counts["resyncs"] += 1
            try:
                await self._bus.publish(self.subjects.control(iid), m.KVResync(
                    instance_id=iid, reason=f"{self.router_id}: batch before {view.seq} missing"))
            except KVStreamError as exc:
                log.warning("router %s: asking %s to resync failed: %s", self.router_id, iid,
                            exc)

    # -- routing --------------------------------------------------------------------
    async def _on_route(self, msg: m.ControlUnion, headers: dict[str, str]
                        ) -> m.ControlMessage | None:
        if not isinstance(msg, m.Route):
            return m.Reject(transfer_id="", code="malformed", reason="not a Route")
        self._counts["routed"] += 1
        cfg = self.config
        out = []
        for role in dict.fromkeys(msg.legs):
            weight = cfg.prefill_load_weight if role == "prefill" else cfg.decode_load_weight
            d = decide(self.directory, self.index, msg, role, load_weight=weight,
                       turn=self._turn[role])
            if d is not None:
                self._turn[role] += 1
                out.append(d)
        return m.Routed(router_id=self.router_id, decisions=out)

    def statistics(self) -> RouterStatistics:
        c = self._counts
        return RouterStatistics(routed=c["routed"], events=c["events"], gaps=c["gaps"],
                                repairs=c["repairs"], resyncs=c["resyncs"],
                                refused=c["refused"] + self.index.refused,
                                instances=len(self.index))
