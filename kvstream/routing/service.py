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
import time
import uuid
from collections import Counter
from typing import Any

import anyio
import msgspec

from kvstream._exceptions import ConfigError
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
MAX_BUFFERED = 256  # live batches of one instance held while its view is reread
MAX_REPAIRS = 64  # instances repaired at once (the others wait for their next gap or heartbeat)
REPAIR_PAUSE_S = 5.0  # between two rereads of one instance's events
RESYNC_RETRY_S = 10.0  # between two requests for an instance's listing
MAX_LOAD = 1e12  # Decision.load and .cost (an announced load is a peer's number)


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
    blind: int = 0  # live instances whose KV events are missing or off (their announcement)


def engine_load(announced: list[int], own: int, recent: int) -> float:
    """The requests an engine serves, as one proxy asks: its own there now, plus what the
    engine announced (as of its last heartbeat: all proxies') beyond the most this proxy
    had there lately (``proxy/inflight.py``). Without ``recent`` (an older proxy), the
    larger of the two."""
    ann = max(announced, default=0)
    return float(own + max(0, ann - max(own, recent)))


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
        load = engine_load([a.requests for a in anns], req.inflight.get(inst.url, 0),
                           req.recent.get(inst.url, 0))
        cands.append(Candidate(url=inst.url, instance_ids=inst.instance_ids, blocks=blocks,
                               overlap=overlap, load=load,
                               kv_used=max((a.kv_used for a in anns), default=0)))
    best = choose(cands, load_weight=load_weight, turn=turn)
    if best is None:
        return None
    c = best.candidate
    return m.Decision(role=role, url=c.url, instance_ids=list(c.instance_ids),
                      overlap=c.overlap, blocks=c.blocks, load=min(c.load, MAX_LOAD),
                      cost=min(best.cost, MAX_LOAD), candidates=len(cands))


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
        # Instances whose view is being repaired: None until the reread starts, then the
        # live batches that arrive during it.
        self._repairing: dict[str, list[m.KVEvents] | None] = {}
        self._last_repair: dict[str, float] = {}
        self._asked: dict[str, float] = {}  # when an instance was last asked for a listing
        self._keys: dict[str, bytes] = {}  # the announced key each view was read under
        self._heard: dict[str, tuple[str, int]] = {}  # the latest batch each announced
        self._blind: dict[str, str] = {}  # instances whose events are missing or off: why
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
        # announcements signed by the instance they name, and events signed with the key
        # that instance announced: the stream keeps earlier incarnations' events too, and
        # those must neither count nor bind a key (``_kv_trust``).
        registry = self.directory.registry
        bus.seal.identity = Identity(self.router_id)
        bus.seal.trust = registry.bind_key
        bus.seal.key_of = registry.key_of  # what goes to one instance is boxed for it
        bus.seal.registry_prefix = self.subjects.registry_prefix
        await bus.serve(self.subjects.registry_all, self._on_registry)
        await bus.flush()
        await bus.follow(self.subjects.kv_events_all, self._stream, self._on_events,
                         trust=self._kv_trust)
        await bus.serve(self.subjects.route, self._on_route, queue=ROUTERS)
        await bus.flush()
        log.info("router %s serving %s", self.router_id, self.subjects.route)

    def _kv_trust(self, instance_id: str, key: bytes, announced: bool) -> bool:
        info = self.directory.registry.get(instance_id)
        return info is not None and info.announced and info.key == key

    async def _on_registry(self, msg: m.ControlUnion, headers: dict[str, str]) -> None:
        iid = getattr(msg, "instance_id", None)
        if not isinstance(iid, str) or iid != headers.get(SENDER) or \
                headers.get(SUBJECT) != self.subjects.registry_prefix + iid:
            return None
        self.directory.observe(msg)
        if isinstance(msg, m.Leave):
            self.index.forget(iid)
            self._keys.pop(iid, None)
            self._heard.pop(iid, None)
            self._blind.pop(iid, None)
        elif isinstance(msg, m.Announce):
            self._check_events(msg)
            self._check_view(msg)
        return None

    def _check_events(self, ann: m.Announce) -> None:
        """Say (once per change) when an instance's KV events do not reach the stream:
        routing by prefix cannot see what it holds."""
        iid, state = ann.instance_id, ann.kv_events
        was = self._blind.get(iid)
        if state in ("missing", "off"):
            if was != state:
                log.warning("router %s: %s's KV events are %s (%s): routing by prefix is "
                            "blind to it", self.router_id, iid, state,
                            "it stored blocks and published no event" if state == "missing"
                            else "its engine publishes none")
                self._blind[iid] = state
                if len(self._blind) > self.index.max_instances:
                    self._blind.pop(next(iter(self._blind)))
        elif was is not None:
            log.info("router %s: %s's KV events arrive (%s)", self.router_id, iid,
                     state or "not said")
            del self._blind[iid]

    def _check_view(self, ann: m.Announce) -> None:
        """Repair ``ann``'s instance's view when its key is new to this router (its events
        so far were not believed), when it lacks a batch the instance announced a
        heartbeat ago (a lost last batch has no later one to show the gap), or ask again
        for a listing a stale view still waits for."""
        iid = ann.instance_id
        info = self.directory.registry.get(iid)
        key = info.key if info is not None and info.announced else b""
        if key and self._keys.get(iid) != key:
            # Marked read under this key once its reread is under way (else: the next
            # heartbeat tries again, e.g. when MAX_REPAIRS others are being read).
            if self._want_repair(iid, "its key is new here") or iid in self._repairing:
                self._keys[iid] = key
                if len(self._keys) > self.index.max_instances:
                    self._keys.pop(next(iter(self._keys)))
            return
        view = self.index.view(iid)
        before = self._heard.get(iid)
        self._heard[iid] = (ann.kv_epoch, ann.kv_seq)
        if len(self._heard) > self.index.max_instances:
            self._heard.pop(next(iter(self._heard)))
        if before is not None and before[1] and (
                view is None or (view.epoch != before[0] and before[0] not in self.index.retired(iid))
                or (view.epoch == before[0] and view.seq < before[1])):
            self._want_repair(iid, f"batch {before[1]} was announced, not seen")
        elif view is not None and view.stale and \
                time.monotonic() - self._asked.get(iid, -RESYNC_RETRY_S) > RESYNC_RETRY_S:
            self._tg.start_soon(self._ask_resync, iid, view.seq)

    # -- KV events ------------------------------------------------------------------
    def _checked(self, msg: m.ControlUnion, headers: dict[str, str]) -> m.KVEvents | None:
        """The batch, if signed by the instance it names on that instance's own subject."""
        if not isinstance(msg, m.KVEvents) or msg.instance_id != headers.get(SENDER) or \
                headers.get(SUBJECT) != f"{self.subjects.prefix}.kvev.{msg.instance_id}":
            self._counts["refused"] += 1
            return None
        return msg

    async def _on_events(self, msg: m.ControlUnion, headers: dict[str, str]) -> None:
        batch = self._checked(msg, headers)
        if batch is None:
            return None
        iid = batch.instance_id
        if iid in self._repairing:
            held = self._repairing[iid]
            # Before the reread starts the reread has it; during it, applied after it.
            if held is not None and len(held) < MAX_BUFFERED:
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
        if got == "gap":
            self._counts["gaps"] += 1
            self._want_repair(batch.instance_id, f"batch {batch.seq} showed a gap")

    def _want_repair(self, iid: str, why: str) -> bool:
        """Reread ``iid``'s events from the stream, at most once per ``REPAIR_PAUSE_S``
        per instance (a peer that makes gaps on purpose costs a reread per pause); False
        if not scheduled (one is under way, or ``MAX_REPAIRS`` are)."""
        if iid in self._repairing or len(self._repairing) >= MAX_REPAIRS:
            return False
        wait = self._last_repair.get(iid, -REPAIR_PAUSE_S) + REPAIR_PAUSE_S - time.monotonic()
        self._repairing[iid] = None
        log.debug("router %s: repairing %s's view (%s)", self.router_id, iid, why)
        self._tg.start_soon(self._repair, iid, max(0.0, wait))
        return True

    async def _repair(self, iid: str, wait: float) -> None:
        """Reread ``iid``'s batches from the stream; still a gap: ask it for a listing.
        Never raises (a peer's bad batch must not end the router)."""
        assert self._bus is not None
        kept = None
        try:
            if wait:
                await anyio.sleep(wait)
            self._last_repair[iid] = time.monotonic()
            if len(self._last_repair) > 2 * MAX_REPAIRS:
                self._last_repair.pop(next(iter(self._last_repair)))
            self._counts["repairs"] += 1
            self._repairing[iid] = []
            kept = await self._bus.kept(self.subjects.kv_events(iid), self._stream,
                                        trust=self._kv_trust)
        except Exception as exc:
            log.warning("router %s: rereading %s's KV events failed: %r", self.router_id,
                        iid, exc)
        finally:
            held = self._repairing.pop(iid, None) or []
            if kept is not None:
                self.index.forget(iid)
                for msg, headers in kept:
                    batch = self._checked(msg, headers)
                    if batch is not None:
                        self.index.apply(batch)
            for batch in held:
                self.index.apply(batch)
        view = self.index.view(iid)
        heard = self._heard.get(iid)
        behind = view is not None and heard is not None and view.epoch == heard[0] and \
            view.seq < heard[1]  # the instance announced a batch the stream does not have
        if view is not None and (view.stale or behind):
            view.stale = True
            await self._ask_resync(iid, view.seq)

    async def _ask_resync(self, iid: str, seq: int) -> None:
        assert self._bus is not None
        self._asked[iid] = time.monotonic()
        if len(self._asked) > self.index.max_instances:
            self._asked.pop(next(iter(self._asked)))
        self._counts["resyncs"] += 1
        try:
            await self._bus.publish(self.subjects.control(iid), m.KVResync(
                instance_id=iid, reason=f"{self.router_id}: a batch before {seq} is missing"),
                peer=iid)
        except Exception as exc:
            log.warning("router %s: asking %s to resync failed: %r", self.router_id, iid, exc)

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
                                instances=len(self.index),
                                blind=sum(1 for i in self._blind
                                          if self.directory.registry.alive(i)))
