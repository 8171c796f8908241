"""Layer-pipelined push for vLLM (issue 20): both legs at once, the prefill pushes.

The proxy (``--transfer push``) sends the decode leg with the prefill leg, naming each to
the other: the prefill request's ``kv_transfer_params["kvstream"]`` carry ``push_to`` (the
decode engine's instance id), ``push_id`` and ``secret``; the decode request's carry
``transfer_mode: "push"`` and the prefill engine's id. The decode engine allocates blocks
and ``expect()``s the push into them; the prefill rank, in the step that completes the
prompt, offers the blocks (under the push id, for a pull) and pushes them, each layer as
vLLM saves it (``save_kv_layer``), so only the last layer's bytes follow the forward. A
push that arrives before the decode engine has allocated waits in its staging pool.

Every way it can go wrong ends in a pull or a recompute, never a hang: a push that fails
notes "failed" to the decode rank, which pulls the offer instead (its reservation is
bounded by ``reservation_timeout_s`` if the note is lost); a decode request that ends or is
declined before its load notes "declined", so the prefill neither pushes nor holds. A
successful push ends the offer (nothing will pull it) and so frees the prefill's blocks.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio

from kvstream._exceptions import AdapterError
from kvstream.adapters.vllm import ranks
from kvstream.adapters.vllm.common import Offer
from kvstream.control.push_notes import PUSH_TOPIC, PushNote, decode_note, encode_note

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from kvstream.adapters.runtime import AgentRuntime
    from kvstream.engine.agent import Agent
    from kvstream.layout import KVLayout
    from kvstream.transfer import TransferResult
    from kvstream.transfer.handles import ReceiveHandle, SendHandle

__all__ = ["MAX_DECLINED", "MAX_EARLY_PER_SENDER", "PUSH_LIVENESS_S", "DecodePushes", "NoPush",
           "PrefillPushes", "PushNote", "cuda_event", "decode_note", "send_note"]

log = logging.getLogger("kvstream.adapters.vllm")

MAX_DECLINED = 4096  # push ids declined (or failed) before they were expected, oldest out first
MAX_EARLY_PER_SENDER = 256  # of those "failed" ones, kept from any one sender
PUSH_LIVENESS_S = 0.5  # how often a decode rank waiting for a push checks its source lives


async def send_note(agent: Agent, peer: str, push_id: str,
                    state: Literal["declined", "failed"], reason: str) -> None:
    try:
        await agent.note(peer, PUSH_TOPIC, encode_note(push_id, state, reason))
    except Exception as exc:  # the peer's bounded wait covers a lost note
        log.debug("note %s %s to %s failed: %r", state, push_id, peer, exc)


@dataclass(eq=False)
class _Push:
    rid: str                 # the prefill engine's request id
    offer: Offer
    dst: str                 # the decode rank's instance id
    offer_handle: SendHandle
    ready: set[int] = field(default_factory=set)   # layers vLLM saved
    handle: SendHandle | None = None
    declined: str = ""       # why the decode side no longer wants it ("": it does)
    done: anyio.Event = field(default_factory=anyio.Event)  # the push ended, stopped


class PrefillPushes:
    """One prefill rank's pushes, by push id. Everything runs on the agent's loop."""

    def __init__(self, rt: AgentRuntime, tp_rank: int, tp_size: int, layout: KVLayout,
                 events: Callable[..., None]) -> None:
        self._rt = rt
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._layout = layout
        self._events = events
        self._pushes: dict[str, _Push] = {}
        # push id -> (who declined, why), for a decline that came before the push began
        self._declined: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()

    def dst_of(self, offer: Offer) -> str:
        return ranks.instance(offer.push_to, self._tp_rank, self._tp_size)

    def begin(self, rid: str, offer: Offer, offer_handle: SendHandle) -> None:
        """The offer is made (not ready): push it too, unless the decode side declined."""
        st = _Push(rid=rid, offer=offer, dst=self.dst_of(offer), offer_handle=offer_handle)
        early = self._declined.pop(offer.offer_id, None)
        if early is not None and early[0] == st.dst:
            st.declined = early[1]
        self._pushes[offer.offer_id] = st
        self._rt.spawn(self._run, st)

    async def ended(self, push_id: str) -> None:
        """Until the push of ``push_id`` (if any) has ended: vLLM may free the blocks only
        then (the offer's end alone does not say the push stopped reading them)."""
        st = self._pushes.get(push_id)
        if st is not None:
            await st.done.wait()

    def abort(self, push_id: str, reason: str) -> None:
        """The prefill request ended abnormally: stop its push too."""
        st = self._pushes.get(push_id)
        if st is None:
            return
        st.declined = st.declined or reason
        if st.handle is not None:
            self._rt.spawn(st.handle.abort, reason)

    async def mark(self, push_ids: list[str], layer: int, event: Any | None) -> None:
        """vLLM saved ``layer`` for these pushes (``event``: the CUDA event recorded after
        the layer's KV write on vLLM's stream, waited here: only then is the layer ready)."""
        if event is not None and not event.query():
            await anyio.to_thread.run_sync(event.synchronize)
        for pid in push_ids:
            st = self._pushes.get(pid)
            if st is None or layer in st.ready:
                continue
            st.ready.add(layer)
            if st.handle is not None:
                st.handle.layer_ready(layer)

    def all_ready(self, push_id: str) -> None:
        """The step's forward is done: every layer is final (a backend that never called
        ``save_kv_layer`` pushes eagerly this way)."""
        st = self._pushes.get(push_id)
        if st is None:
            return
        st.ready.update(range(self._layout.num_layers))
        if st.handle is not None:
            st.handle.all_ready()

    def on_note(self, sender: str, body: bytes) -> None:
        note = decode_note(body)
        if note is None or note.state != "declined":
            return
        st = self._pushes.get(note.push_id)
        if st is None:
            self._declined[note.push_id] = (sender, note.reason)
            while len(self._declined) > MAX_DECLINED:
                self._declined.popitem(last=False)
            return
        if sender != st.dst or st.declined:
            return
        st.declined = note.reason or "declined by the decode side"
        if st.handle is not None:
            self._rt.spawn(st.handle.abort, f"the decode side declined: {st.declined}")
        self._rt.spawn(st.offer_handle.abort, f"the decode side declined: {st.declined}")

    async def _run(self, st: _Push) -> None:
        agent = self._rt.agent
        pid = st.offer.offer_id
        ok, why = False, ""
        try:
            if agent is None:
                raise AdapterError("agent closed")
            if st.declined:
                await st.offer_handle.abort(f"not pushed: {st.declined}")
                return
            why = self._refusal(agent, st.dst)
            if why:
                raise AdapterError(why)
            handle = await agent.push(pid, st.dst, st.offer.blocks, mode="pipelined",
                                      block_hashes=st.offer.hashes)
            st.handle = handle
            for layer in sorted(st.ready):
                handle.layer_ready(layer)
            if st.declined:
                await handle.abort(f"the decode side declined: {st.declined}")
            res = await handle.result()
            ok, why = res.ok, res.reason
            self._events("push_ended", request_id=st.rid, push_id=pid, dst=st.dst, ok=ok,
                         reason=why, bytes=res.bytes, skipped=res.bytes_skipped,
                         seconds=res.seconds)
        except Exception as exc:  # whatever failed, the decode side must hear of it
            ok, why = False, why or f"{type(exc).__name__}: {exc}"
            self._events("push_ended", request_id=st.rid, push_id=pid, dst=st.dst, ok=False,
                         reason=why)
        finally:
            self._pushes.pop(pid, None)
            st.done.set()
        if ok:
            # The offer stays until the decode rank releases it (it has the KV in its
            # blocks) or its lease ends: a push that landed in staging may still be
            # dropped there unclaimed, and then the decode rank pulls.
            log.debug("kvstream push %s (%s) to %s done", st.rid, pid, st.dst)
        elif not st.declined and agent is not None:
            log.warning("kvstream push %s (%s) to %s failed: %s; its offer stays for a pull",
                        st.rid, pid, st.dst, why)
            await send_note(agent, st.dst, pid, "failed", why)

    def _refusal(self, agent: Agent, dst: str) -> str:
        """Why this rank does not push to ``dst`` ("": it does): only into a rank announcing
        this rank's layout and TP share, which the proxy checked too (a client may have
        written the params)."""
        ann = next((a for a in agent.peers() if a.instance_id == dst), None)
        if ann is None:
            return f"{dst} is not announced here"
        if ann.role not in ("decode", "both"):
            return f"{dst} is a {ann.role} instance"
        if ann.layout is None or ann.layout.fingerprint != self._layout.fingerprint:
            return f"{dst} registers another KV layout"
        tp = ann.tp
        if (tp.size if tp else 1) != self._tp_size or (tp.rank if tp else 0) != self._tp_rank:
            return f"{dst} is not this rank's peer at TP {self._tp_size}"
        return ""


class NoPush(Exception):
    """The push will not come: pull at once, unless ``offered`` is False (nothing was
    offered either: recompute)."""

    def __init__(self, message: str, *, offered: bool = True) -> None:
        super().__init__(message)
        self.offered = offered


class DecodePushes:
    """One decode rank's awaited pushes, by push id. Everything runs on the agent's loop."""

    def __init__(self, rt: AgentRuntime) -> None:
        self._rt = rt
        # push id -> (who may note it failed: its source rank and the proxy that planned it,
        # the reservation)
        self._expecting: dict[str, tuple[frozenset[str], ReceiveHandle]] = {}
        # (push id, who) -> the "failed" notes that came before the expect (by sender:
        # one from a peer whose note does not count must not hide one that does)
        self._failed: collections.OrderedDict[tuple[str, str], PushNote] = \
            collections.OrderedDict()
        # push id -> a "failed" note that ended its wait, for the fallback to read
        self._ended: dict[str, PushNote] = {}
        self._failed_by: collections.Counter[str] = collections.Counter()  # kept per sender

    def on_failed(self, sender: str, note: PushNote) -> None:
        """A "failed" note (from the source rank, or the proxy whose prefill leg failed)
        hurries the fallback pull; one that comes before this rank expects (the request
        still queues) is kept for then."""
        waiting = self._expecting.get(note.push_id)
        if waiting is None:
            # Bounded in all and per sender: one peer's flood cannot push out the notes
            # of the proxies and ranks whose notes count.
            if (note.push_id, sender) in self._failed:
                return
            if self._failed_by[sender] >= MAX_EARLY_PER_SENDER:  # its oldest goes (stale:
                # a push that ended, a request aborted before it expected)
                oldest = next(k for k in self._failed if k[1] == sender)
                del self._failed[oldest]
                self._forget(sender)
            self._failed[note.push_id, sender] = note
            self._failed_by[sender] += 1
            while len(self._failed) > MAX_DECLINED:
                (_, who), _ = self._failed.popitem(last=False)
                self._forget(who)
        elif sender in waiting[0] and not waiting[1].done:
            self._ended[note.push_id] = note
            self._rt.spawn(waiting[1].abort, f"{sender}: no push: {note.reason}"[:300])

    def _forget(self, sender: str) -> None:
        self._failed_by[sender] -= 1
        if self._failed_by[sender] <= 0:
            del self._failed_by[sender]

    async def take(self, agent: Agent, push_id: str, blocks: list[int], have: Iterable[int],
                   src: str, started: Callable[[ReceiveHandle], Any], by: str = ""
                   ) -> TransferResult:
        """The prefill's push into ``blocks`` (claimed from staging if it came first);
        bounded by ``reservation_timeout_s``, hurried by a "failed" note from ``src`` or
        ``by`` (the proxy that planned it), given up when ``src`` is no longer alive.
        ``started`` gets the reservation (to abort it). Raises ``NoPush`` when a note
        ended it (its ``offered`` says whether a pull may find the offer)."""
        if push_id in self._expecting:
            raise AdapterError(f"push {push_id} is expected by another request here")
        notifiers = frozenset(x for x in (src, by) if x)
        for who in sorted(notifiers):
            early = self._failed.pop((push_id, who), None)
            if early is not None:
                self._forget(who)
                raise NoPush(f"{who}: no push: {early.reason}", offered=early.offered)
        handle = agent.expect(push_id, blocks, have=have, src=src)
        self._expecting[push_id] = (notifiers, handle)
        try:
            await started(handle)
            while True:  # a prefill that died before its push never sends a note
                with anyio.move_on_after(PUSH_LIVENESS_S):
                    res = await handle.result()
                    note = self._ended.get(push_id)
                    if note is not None and not note.offered and not res.ok:
                        raise NoPush(res.reason, offered=False)
                    return res
                if not agent.registry.alive(src):
                    await handle.abort(f"{src} is not alive (no push will come)")
        finally:
            self._expecting.pop(push_id, None)
            self._ended.pop(push_id, None)


def cuda_event(kv_layer: torch.Tensor) -> Any | None:
    """An event recorded after the layer's KV write, on the stream vLLM writes it on (the
    layer's device's current stream: ``save_kv_layer`` runs on vLLM's forward thread);
    None on CPU, where the write is done when vLLM calls."""
    if not kv_layer.is_cuda:
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(kv_layer.device))
    return ev
