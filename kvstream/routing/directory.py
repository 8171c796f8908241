"""Which engine gets a request: static URLs plus the registry's live instances.

Pure bookkeeping for ``kvstream proxy`` and the routers (the clock is injected through the
``Registry``): they feed it the registry's announcements and ask it where a leg can go. Engines
are routed by their HTTP endpoint, so the kvstream instances of one engine's TP ranks,
which all announce the same endpoint, collapse into one ``Instance``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from kvstream.config import check_endpoint
from kvstream.control import messages as m
from kvstream.control.registry import Registry

__all__ = ["Directory", "Instance", "LegRole", "pick"]

LegRole = Literal["prefill", "decode"]


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    """A routable engine: its HTTP base URL and what the registry says about it."""

    url: str
    # kvstream instances announcing this URL (several for TP ranks); () for a static URL.
    instance_ids: tuple[str, ...] = ()
    load: float = 0.0  # the largest ``Announce.load`` among them (transfers in flight)
    # What its instances say of their KV events, the worst first ("": not said)
    kv_events: str = ""


# The states ``Announce.kv_events`` names, the worst first: a router is blind to an engine
# whose events are "missing" or "off".
_EVENT_STATES = ("missing", "off", "waiting", "ok", "")


def _known(state: str) -> str:
    return state if state in _EVENT_STATES else ""  # a newer peer's state: not said


def pick(instances: Sequence[Instance], inflight: Mapping[str, int], turn: int) -> Instance | None:
    """The least loaded instance, None if there is none.

    Least loaded = fewest requests this proxy has in flight there (what it knows for
    sure, at once), then the lowest announced load (other proxies' and engines' work,
    up to a heartbeat old); among what still ties, round robin by ``turn`` (ties ordered
    by URL, so consecutive turns walk through them).
    """
    if not instances:
        return None

    def key(i: Instance) -> tuple[int, float]:
        return inflight.get(i.url, 0), i.load

    best = min(key(i) for i in instances)
    ties = sorted((i for i in instances if key(i) == best), key=lambda i: i.url)
    return ties[turn % len(ties)]


class Directory:
    """Where requests can go: the static URLs, and every instance whose announcement has
    an endpoint and whose heartbeat is fresh (``peer_timeout_s``), minus URLs the proxy
    could not connect to in the last ``peer_timeout_s`` (``mark_unreachable``)."""

    def __init__(self, *, prefill: Iterable[str] = (), decode: Iterable[str] = (),
                 peer_timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = Registry(peer_timeout_s=peer_timeout_s, clock=clock)
        self._clock = clock
        self._peer_timeout_s = peer_timeout_s
        self._unreachable: dict[str, float] = {}  # URL -> until when it is not routed to
        self._static: dict[LegRole, list[str]] = {
            "prefill": list(dict.fromkeys(check_endpoint(u.rstrip("/")) for u in prefill)),
            "decode": list(dict.fromkeys(check_endpoint(u.rstrip("/")) for u in decode)),
        }

    def observe(self, msg: m.ControlUnion) -> None:
        """Feed one registry message (announcement or goodbye)."""
        match msg:
            case m.Announce():
                self.registry.observe(msg)
            case m.Leave():
                self.registry.leave(msg.instance_id)

    def mark_unreachable(self, url: str) -> None:
        """Route nothing to ``url`` for ``peer_timeout_s``: a connection to it just failed.

        The registry would drop a dead engine within ``peer_timeout_s`` anyway; a static URL
        it never drops, and until then every request would try it first. After the pause
        the URL is tried again (an engine that came back is used again)."""
        self._unreachable[url.rstrip("/")] = self._clock() + self._peer_timeout_s

    def instances(self, role: LegRole) -> list[Instance]:
        """Routable instances for one leg ("both" instances serve either)."""
        now = self._clock()
        for url in [u for u, until in self._unreachable.items() if until <= now]:
            del self._unreachable[url]
        found: dict[str, Instance] = {url: Instance(url=url) for url in self._static[role]}
        announced: dict[str, list[m.Announce]] = {}
        for a in self.registry.instances(role):
            if a.endpoint:
                announced.setdefault(a.endpoint.rstrip("/"), []).append(a)
        for url, group in announced.items():
            found[url] = Instance(url=url, instance_ids=tuple(sorted(a.instance_id for a in group)),
                                  load=max(a.load for a in group),
                                  kv_events=min((_known(a.kv_events) for a in group),
                                                key=_EVENT_STATES.index))
        return [i for url, i in found.items() if url not in self._unreachable]

    def engine_instances(self, engine_id: str) -> list[str]:
        """The kvstream instances behind one engine id: itself, or its TP ranks
        (``<id>-tp<rank>``) when those are what announced. Unknown: ``[engine_id]``."""
        rank = re.compile(re.escape(engine_id) + r"-tp\d+")
        ids = [a.instance_id for a in self.registry.instances()
               if a.instance_id == engine_id or rank.fullmatch(a.instance_id)]
        return sorted(ids) or [engine_id]
