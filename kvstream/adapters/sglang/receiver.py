"""The decode side of one request: SGLang's ``BaseKVReceiver`` over a kvstream pull.

``init`` plans which prefill ranks this rank turns to (``transfer.ranks.asks``: the same
TP degree, one rank; a lower one, a gather of heads from several; a higher one, its
heads of one rank's offer shared with sibling ranks; MLA, the latent from one rank);
``send_metadata`` tells each the pages are allocated (``Want``, and whether it is read);
once every rank read has answered ``Ready``, one pull (or gather) moves the KV; ``poll()``
writes the aux row (the room last) once every page landed and only then says ``Success``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from kvstream._exceptions import AdapterError, KVStreamError
from kvstream.adapters.sglang import notes
from kvstream.adapters.sglang.manager import KVStreamKVManager, instance_for
from kvstream.adapters.sglang.side import Side, rid
from kvstream.adapters.sglang.state import HEADS, group_instance, state_lists
from kvstream.transfer import ranks

__all__ = ["KVStreamKVReceiver"]


class KVStreamKVReceiver(Side, BaseKVReceiver):
    side = "decode"
    require_staging = False

    def __init__(self, mgr: KVStreamKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None, **_: Any) -> None:
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self._init_side()
        self.abort_notified = False
        self.asked: dict[str, bool] = {}  # prefill rank instance -> read from it
        self.srcs: list[str] = []  # those read, in rank order (a gather's parts)
        self.readers = 1  # decode ranks sharing the one source's offer (decode TP above)
        self.prefill_tp = mgr.tp_size
        self.inited = False
        self.pages: list[int] | None = None
        self.aux_index: int | None = None
        self.sent_at = 0.0
        self.readys: dict[str, notes.Ready] = {}
        self.ready: notes.Ready | None = None  # the first source's, once all answered
        self.handle: Any = None
        self.result: Any = None
        self.state: list[list[int]] = []  # side state: this request's items per component
        self.state_handles: list[Any] = []  # their pulls, one per group with items
        self._starting: anyio.Event | None = None
        with mgr._lock:
            mgr.receivers[self.room] = self

    def peers(self) -> list[str]:
        return list(self.asked)

    def init(self, prefill_dp_rank: int = 0) -> None:
        mgr = self.kv_mgr
        info = mgr.prefill_info_table.get(self.bootstrap_addr)
        tp = info.tp_size if info is not None else mgr.tp_size
        total = mgr.total_kv_heads
        why = None
        if info is not None and info.mla != mgr.is_mla:
            why = "an MLA pool on one side and K/V pools on the other"
        elif info is not None and info.page_size and info.page_size != mgr.page_size:
            why = (f"page size mismatch: the prefill's page_size={info.page_size}, this "
                   f"decode's {mgr.page_size}: both servers must use the same --page-size")
        elif info is not None and not mgr.is_mla and info.total_kv_heads != total and \
                mgr.opaque is None:
            why = f"the prefill's model has {info.total_kv_heads} KV heads, this one {total}"
        elif tp != mgr.tp_size and mgr.opaque is not None:
            why = (f"prefill TP {tp}, decode TP {mgr.tp_size}, and {mgr.opaque}: its pages "
                   "move only between equal TP degrees")
        elif mgr.side is not None and tp != mgr.tp_size and mgr.side.equal_tp_only():
            why = (f"side state {mgr.side.equal_tp_only()} moves only between equal TP "
                   f"degrees: prefill TP {tp}, decode TP {mgr.tp_size}")
        elif not mgr.is_mla:
            why = ranks.refusal(tp, mgr.tp_size, total)
        self.prefill_tp = tp
        if why is None:
            asks = ranks.asks(mgr.rank, tp, mgr.tp_size, 0 if mgr.is_mla else total)
            self.asked = {instance_for(self.bootstrap_addr, p): read for p, read in asks.items()}
            self.srcs = [inst for inst, read in self.asked.items() if read]
            if len(self.srcs) == 1:
                self.readers = ranks.readers(next(p for p, r in asks.items() if r), tp,
                                             mgr.tp_size)
        else:  # refused: every prefill rank hears it (each may have been asked otherwise)
            self.asked = {instance_for(self.bootstrap_addr, p): False
                          for p in range(min(tp, ranks.MAX_TP))}
        self.inited = True
        if why is not None:
            self.fail(why)

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None,
                      state_indices: Any = None, decode_prefix_len: int | None = None,
                      **_: Any) -> None:
        if self.failure is not None:
            return
        mgr = self.kv_mgr
        side = mgr.side
        if side is not None and state_indices is None:
            self.fail(f"no side state indices for {', '.join(side.kinds)} (a host-memory "
                      "destination? not supported)")
            return
        try:
            self.state = state_lists(state_indices, len(side.kinds) if side else 0)
        except AdapterError as exc:
            self.fail(str(exc))
            return
        self.pages = [int(i) for i in kv_indices]
        self.aux_index = aux_index
        self.sent_at = time.monotonic()
        for peer, read in self.asked.items():
            mgr.send_note(peer, notes.Want(
                room=self.room, pages=len(self.pages), prefix_len=int(decode_prefix_len or 0),
                tp_rank=mgr.rank, tp_size=mgr.tp_size, read=read,
                readers=self.readers if read else 1, kv_dtype=mgr.kv_dtype,
                state_kinds=side.kinds if side else [],
                state=[len(idx) for idx in self.state]))

    def readied(self, sender: str, ready: notes.Ready) -> None:
        """On the agent's loop: a prefill rank read offered its pages; pull once all did."""
        if self.failure is not None or self.ready is not None or self.pages is None or \
                sender in self.readys:
            return
        if ready.pages != len(self.pages):
            self.fail(f"{sender} offers {ready.pages} pages for {len(self.pages)} allocated")
            return
        why = self._state_refusal(ready)
        first = next(iter(self.readys.values()), None)
        if not why and first is not None and ready.state != first.state:
            why = f"side state counts {ready.state}, the other prefill ranks' {first.state}"
        if why:
            self.fail(f"{sender}: {why}")
            return
        self.readys[sender] = ready
        if len(self.readys) < len(self.srcs):
            return
        self.ready = self.readys[self.srcs[0]]  # every rank wrote the same aux row
        if ready.pages or any(ready.state_secrets):
            self._starting = anyio.Event()
            self.kv_mgr.rt.spawn(self._pull)

    def _state_refusal(self, ready: notes.Ready) -> str:
        """Why a Ready's side state does not fit this request ("": it does): a secret per
        group, an item count per component, none above what was allocated here."""
        side = self.kv_mgr.side
        if side is None:
            return "side state offered to a decode without any" if (
                ready.state_secrets or any(ready.state)) else ""
        if len(ready.state_secrets) != len(side.groups) or len(ready.state) != len(self.state):
            return (f"side state of {len(ready.state_secrets)} groups, {len(ready.state)} "
                    f"components for {len(side.groups)}, {len(self.state)} here")
        for grp, secret in zip(side.groups, ready.state_secrets, strict=True):
            n = ready.state[grp.component]
            if n > len(self.state[grp.component]) or bool(secret) != bool(n):
                return (f"side state {grp.kind}: {n} items offered for "
                        f"{len(self.state[grp.component])}")
        return ""

    async def _pull(self) -> None:
        mgr = self.kv_mgr
        if self.pages is None or self._starting is None:  # readied() set them
            raise AdapterError("a pull before the prefill's Ready")
        srcs, ready = self.srcs, self.readys[self.srcs[0]]
        try:
            if not ready.pages:
                pass  # everything was cached here: only side state moves
            elif len(srcs) == 1:
                self.handle = await mgr.agent.pull(
                    rid(self.room), srcs[0], self.pages, mode="eager",
                    secret=ready.secret, readers=self.readers)
            else:  # a gather of heads
                self.handle = await mgr.agent.pull(
                    rid(self.room), srcs, self.pages, mode="eager",
                    secret=[self.readys[s].secret for s in srcs])
            await self._pull_state(srcs)
        except KVStreamError as exc:
            self.fail(f"the pull from {','.join(srcs)} failed: {exc}")
            return
        finally:
            self._starting.set()
        handles = [h for h in (self.handle, *self.state_handles) if h is not None]
        if self.failure is not None:  # aborted while it started
            for h in handles:
                await h.abort("the decode request was aborted")
        results: list[Any] = []

        async def one(h: Any) -> None:  # the first to fail fails the request (and stops the rest)
            res = await h.result()
            results.append(res)
            if not res.ok:
                self.fail(f"the pull from {','.join(srcs)} ended {res.status}: {res.reason}")

        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(one, h)
        if self.failure is None:
            self.result = results[0] if results else True

    async def _pull_state(self, srcs: list[str]) -> None:
        """Each side-state group's items of this request, from the source ranks' agents
        of that group: a HEADS group as the pages move (a gather of heads, or this rank's
        heads of a shared offer), the others whole from the one source."""
        side = self.kv_mgr.side
        if side is None:
            return
        first = self.readys[srcs[0]]
        # The side agents start after their rank's: an announcement may still be on the
        # way. One deadline for them all, so abort() (waiting for this to start) is not
        # held past it by groups that never announce.
        deadline = time.monotonic() + self.kv_mgr.agent.config.peer_timeout_s
        for g, (grp, agent) in enumerate(zip(side.groups, side.agents, strict=True)):
            if not first.state_secrets[g]:
                continue
            items = self.state[grp.component][:first.state[grp.component]]
            peers = [group_instance(s, g) for s in srcs]
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                while any(agent.registry.announced(p) is None for p in peers) and \
                        self.failure is None:
                    await anyio.sleep(0.05)
            if self.failure is not None:
                return  # aborted or failed meanwhile: start no more pulls
            if len(srcs) > 1 and grp.split == HEADS:
                handle = await agent.pull(rid(self.room), peers, items, mode="eager",
                                          secret=[self.readys[s].state_secrets[g] for s in srcs])
            elif len(srcs) > 1:  # MLA reads one rank: HEADS is the only split gathered
                raise AdapterError(f"side state {grp.kind} ({grp.split}) from {len(srcs)} ranks")
            else:
                handle = await agent.pull(rid(self.room), peers[0], items, mode="eager",
                                          secret=first.state_secrets[g], readers=self.readers)
            self.state_handles.append(handle)

    def _streaming(self) -> bool:
        return self._starting is not None and (not self._starting.is_set() or any(
            not h.done for h in (self.handle, *self.state_handles) if h is not None))

    async def _stop(self) -> None:
        await self._drain()

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.failure is not None:
            before = KVPoll.Transferring if self.pages is not None else (
                KVPoll.WaitingForInput if self.inited else KVPoll.Bootstrapping)
            return self._failed_poll(before)
        if not self.inited:
            return KVPoll.Bootstrapping
        if self.pages is None:
            return KVPoll.WaitingForInput
        ready = self.ready
        if ready is not None and (self.result is not None or not (
                ready.pages or any(ready.state_secrets))):
            try:
                self.kv_mgr.aux.write(int(self.aux_index if self.aux_index is not None else -1),
                                      ready.aux, self.room)
            except AdapterError as exc:
                self.fail(f"the aux row does not fit: {exc}")
                return self.poll()
            self.conclude_state = KVPoll.Success
            return KVPoll.Success
        gone = [s for s in self.srcs if not self.kv_mgr.alive(s)]
        if gone and self.result is None:
            self.fail(f"the prefill rank {gone[0]} is gone")
            return self.poll()
        if time.monotonic() - self.sent_at > self.kv_mgr.waiting_timeout_s:
            self.fail(f"no KV from {','.join(self.srcs)} within "
                      f"{self.kv_mgr.waiting_timeout_s} s")
            return self.poll()
        return KVPoll.Transferring

    async def _drain(self) -> None:
        """Until nothing of this request can write into its pages any more."""
        if self._starting is not None:
            await self._starting.wait()
        for h in (self.handle, *self.state_handles):
            if h is not None and not h.done:
                await h.abort("the decode request was aborted")

    def clear(self) -> None:
        with self.kv_mgr._lock:
            if self.kv_mgr.receivers.get(self.room) is self:
                del self.kv_mgr.receivers[self.room]

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's deferred-release hook: kvstream releases nothing late."""
