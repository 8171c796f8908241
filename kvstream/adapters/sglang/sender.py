"""The prefill side of one request: SGLang's ``BaseKVSender`` over a kvstream offer.

``poll()`` says ``WaitingForInput`` once a decode rank asked (``Want``: it allocated the
pages; SGLang computes only then); the last ``send()`` offers the pages and answers
``Ready`` with the aux row to every decode rank that reads this rank (one, or the
``readers`` sharing it when decode runs a higher TP degree, each pulling its heads);
``Success`` is the offer's completion (every reader read every page), so SGLang frees
the pages only after the last byte left. A rank asked but not read (``Want.read``
False: a replica of heads another rank sends, MLA's latent read from another rank)
succeeds once it computed.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll

from kvstream._exceptions import AdapterError, KVStreamError
from kvstream.adapters.sglang import notes
from kvstream.adapters.sglang.manager import Early, KVStreamKVManager, sglang_timeout
from kvstream.adapters.sglang.side import Side, rid
from kvstream.adapters.sglang.state import moved_counts, state_lists
from kvstream.transfer import ranks

__all__ = ["KVStreamKVSender"]

MAX_UNKNOWN = 64  # notes of one request kept until their sender announced itself


class KVStreamKVSender(Side, BaseKVSender):
    side = "prefill"

    def __init__(self, mgr: KVStreamKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False, **_: Any) -> None:
        self.kv_mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room)
        self._init_side()
        self.wants: dict[str, notes.Want] = {}  # the decode ranks that asked, in order
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.pages: list[int] = []
        self.tokens = 0
        self.ready: notes.Ready | None = None  # what every reader is told, once offered
        self.handle: Any = None
        self.result: Any = None
        self.state: list[list[int]] = []  # side state: this request's items per component
        self.state_handles: list[Any] = []  # their offers, one per group with items
        self._state_left = 0  # of those, not read yet
        # SGLang's waiting timeout, read when the sender is built (as its own backends do),
        # armed at the first poll after init: SGLang stops polling while it computes.
        self.waiting_timeout = sglang_timeout("SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                                              mgr.waiting_timeout_s)
        self.waiting_since: float | None = None
        # Kept on the agent's loop, read from SGLang's thread (never iterate ``wants`` there).
        self._first: notes.Want | None = None  # the first Want: pages and TP of them all
        self._reads = 0  # how many of the wants read this rank
        self._unknown: list[Early] = []  # notes whose sender had not announced itself
        with mgr._lock:
            mgr.senders[self.room] = self
        early = mgr.claim_early(self.room)
        if early:  # on the agent's loop, where every later note is heard
            mgr.rt.call(self._replay, early)

    def _replay(self, early: list[Early]) -> None:
        for peer, note, key in early:
            self.heard(peer, note, key)

    @property
    def want(self) -> notes.Want | None:
        return self._first

    def peers(self) -> list[str]:
        return list(self.wants)

    def heard(self, sender: str, note: notes.Want | notes.Drop, key: bytes) -> None:
        """On the agent's loop: a note for this room (from an instance that was a live
        decode when the note came, or kept until its sender has announced itself:
        ``poll`` retries), signed with ``key``. Whether the decode is still alive is not
        asked again: it may have finished and left while this request queued."""
        mgr = self.kv_mgr
        decode = mgr.decode_role(sender)
        if decode is None:
            if len(self._unknown) < MAX_UNKNOWN:
                self._unknown.append((sender, note, key))
            else:
                mgr.dropped += 1
        elif not decode or mgr.key_of(sender) != key or self._refused(sender, note):
            mgr.dropped += 1  # not a rank that asks this one (a forged or confused peer)
        elif isinstance(note, notes.Drop):
            self.dropped(sender, note.reason)
        else:
            self._wanted(sender, note)

    def _refused(self, sender: str, note: notes.Want | notes.Drop) -> bool:
        """Whether ``sender`` is not decode rank ``note.tp_rank`` of ``note.tp_size`` as it
        announced itself, or that rank does not turn to this prefill rank (in that role),
        or the note disagrees with the ranks that asked before."""
        mgr = self.kv_mgr
        if note.tp_rank >= note.tp_size or mgr.rank_of(sender) not in (
                None, (note.tp_rank, note.tp_size)):
            return True
        first = self._first
        if first is not None and note.tp_size != first.tp_size:
            return True
        if sender in self.wants:  # one Want per rank; its Drop is heard
            return isinstance(note, notes.Want)
        if any(w.tp_rank == note.tp_rank for w in self.wants.values()):
            return True  # another instance asked as that rank
        if mgr.opaque is not None and note.tp_size != mgr.tp_size:
            return False  # opaque pages: a Want fails the request (``_wanted``), a Drop too
        try:
            role = ranks.asks(note.tp_rank, mgr.tp_size, note.tp_size, mgr.total_kv_heads).get(
                mgr.rank)
        except Exception:  # TP degrees whose heads do not split: the decode refused them
            return isinstance(note, notes.Want)
        if role is None:
            return True
        if isinstance(note, notes.Drop):
            return False
        return note.read != role or (role and note.readers != ranks.readers(
            mgr.rank, mgr.tp_size, note.tp_size)) or (
            first is not None and note.pages != first.pages)

    def _wanted(self, sender: str, want: notes.Want) -> None:
        mgr = self.kv_mgr
        self.wants[sender] = want
        self._reads += want.read
        if self.failure is not None:
            if self._told:  # failed and told before this rank asked: tell it too
                mgr.send_note(sender, notes.Drop(room=self.room, reason=self.failure[:1024],
                                                 tp_rank=mgr.rank, tp_size=mgr.tp_size))
            return
        if self._first is None:
            self._first = want
            why = None
            if mgr.opaque is not None and want.tp_size != mgr.tp_size:
                why = (f"decode TP {want.tp_size} against prefill TP {mgr.tp_size}, and "
                       f"{mgr.opaque}: its pages move only between equal TP degrees")
            elif want.kv_dtype and want.kv_dtype != mgr.kv_dtype:
                why = (f"the decode's KV cache dtype/model dtype is {want.kv_dtype}, this "
                       f"prefill's {mgr.kv_dtype}: the bytes would mean other values")
            elif want.state_kinds != (mgr.side.kinds if mgr.side is not None else []):
                why = (f"side state {want.state_kinds or 'none'} at the decode, "
                       f"{mgr.side.kinds if mgr.side is not None else 'none'} here")
            elif mgr.side is not None and want.tp_size != mgr.tp_size and \
                    mgr.side.equal_tp_only():
                why = (f"side state {mgr.side.equal_tp_only()} moves only between equal TP "
                       f"degrees (decode TP {want.tp_size}, prefill TP {mgr.tp_size})")
            if why is not None:
                self.fail(why)
                return
        if self.ready is not None and want.read:
            mgr.send_note(sender, self.ready)  # a reader that asked after the offer

    @property
    def inited(self) -> bool:
        return self.num_pages is not None

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index
        if self.num_pages < 0:
            self.fail(f"{self.num_pages} pages to send (the decode's prefix is longer than "
                      "the prompt?)")

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # a last chunk of no pages still sends the aux row

    def pop_decode_prefix_len(self) -> int:
        return self.want.prefix_len if self.want is not None else 0

    def send(self, kv_indices: Any, state_indices: Any = None,
             num_kv_tokens: int | None = None, **_: Any) -> None:
        if self.failure is not None:
            return
        if self.num_pages is None or self.want is None:
            self.fail("send() before init() or before the decode side asked")
            return
        self.pages += [int(i) for i in kv_indices]
        self.tokens += int(num_kv_tokens or 0)
        # The last chunk is the one that completes the pages ``init`` announced (as SGLang's
        # own backends count); SGLang passes the state list with it, never before.
        last = len(self.pages) == self.num_pages
        if len(self.pages) > self.num_pages or (state_indices is not None and not last):
            self.fail(f"{len(self.pages)} pages sent for {self.num_pages}")
        elif last:
            side, want = self.kv_mgr.side, self.want
            try:
                self.state = state_lists(state_indices, len(side.kinds) if side else 0)
                if side is not None:
                    self.state = [idx[:n] for idx, n in zip(self.state, moved_counts(
                        side.kinds, self.state, list(want.state)), strict=True)]
            except AdapterError as exc:
                self.fail(str(exc))
                return
            self._offer()

    def _offer(self) -> None:
        mgr, want = self.kv_mgr, self.want
        if want is None:  # send() checked it
            raise AdapterError("offering before the decode side asked")
        if not want.read:  # asked, not read: done once computed
            self.result = True
            return
        if mgr.device == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # the forward wrote the pages
        try:
            aux = mgr.aux.read(int(self.aux_index if self.aux_index is not None else -1))
        except AdapterError as exc:
            self.fail(str(exc))
            return
        if self.pages and want.pages != len(self.pages):
            self.fail(f"{len(self.pages)} pages here, {want.pages} allocated at the decode")
            return
        try:
            self.handle = mgr.rt.call(self._offer_on_loop, aux)
        except KVStreamError as exc:
            self.fail(f"offering the pages failed: {exc}")

    def _offer_on_loop(self, aux: list[bytes]) -> Any:
        """Offer the pages (none: everything was cached at the decode, only the aux row
        moves) and tell every reader that asked so far; later ones hear on arrival."""
        mgr, want = self.kv_mgr, self.want
        if self.failure is not None or want is None:  # dropped while SGLang computed
            return None
        handle = None
        secrets_ = self._offer_state()
        if self.pages:
            shared = want.readers
            handle = mgr.agent.offer(rid(self.room), self.pages, mode="eager",
                                     readers=shared if shared > 1 else None)
            handle.all_ready()
            self.handle = handle

            async def watch() -> None:
                res = await handle.result()
                if res.ok:
                    self.result = res
                else:
                    self.fail(f"the pull of the pages ended {res.status}: {res.reason}")

            mgr.rt.spawn(watch)
        self.ready = notes.Ready(room=self.room, secret=handle.secret if handle is not None
                                 else secrets.token_urlsafe(16), tokens=self.tokens,
                                 pages=len(self.pages), aux=aux, state_secrets=secrets_,
                                 state=[len(idx) for idx in self.state])
        for peer, w in self.wants.items():
            if w.read:
                mgr.send_note(peer, self.ready)
        return handle

    def _offer_state(self) -> list[str]:
        """Offer each side-state group's items of this request (on the agent's loop); the
        secrets, "" for a group with none."""
        side, out = self.kv_mgr.side, list[str]()
        if side is None or self.want is None:
            return out
        shared = self.want.readers  # the decode ranks reading this one (as its pages)
        for grp, agent in zip(side.groups, side.agents, strict=True):
            items = self.state[grp.component]
            if not items:
                out.append("")
                continue
            h = agent.offer(rid(self.room), items, mode="eager",
                            readers=shared if shared > 1 else None)
            h.all_ready()
            self.state_handles.append(h)
            self._state_left += 1
            out.append(h.secret)

            async def watch(h: Any = h) -> None:
                res = await h.result()
                if res.ok:
                    self._state_left -= 1
                else:
                    self.fail(f"the pull of the side state ended {res.status}: {res.reason}")

            self.kv_mgr.rt.spawn(watch)
        return out

    def _streaming(self) -> bool:
        return any(h is not None and not h.done for h in (self.handle, *self.state_handles))

    async def _stop(self) -> None:
        for h in (self.handle, *self.state_handles):
            if h is not None and not h.done:
                await h.abort(f"room {self.room}: {self.failure}")

    def _retry(self) -> None:
        unknown, self._unknown = self._unknown, []
        for sender, note, key in unknown:
            self.heard(sender, note, key)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._unknown and self.failure is None:
            self.kv_mgr.rt.call(self._retry)
        if self.failure is not None:
            before = KVPoll.WaitingForInput if self.num_pages is None else KVPoll.Transferring
            return self._failed_poll(before)
        if (self.result is not None or self._told_all()) and not self._state_left:
            self.conclude_state = KVPoll.Success
            return KVPoll.Success
        if self.num_pages is not None:
            now = time.monotonic()
            if self.waiting_since is None:
                self.waiting_since = now
            elif now - self.waiting_since > self.waiting_timeout:
                self.fail(f"not sent and moved within {self.waiting_timeout} s")
                return self.poll()
        if self.num_pages is None:
            if self.want is not None:
                return KVPoll.WaitingForInput
            if time.monotonic() - self.started > self.kv_mgr.bootstrap_timeout_s:
                self.fail(f"no decode engine asked for it within "
                          f"{self.kv_mgr.bootstrap_timeout_s} s")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        return KVPoll.Transferring if self.ready is not None else KVPoll.WaitingForInput

    def _told_all(self) -> bool:
        """Nothing to offer (the decode had it all cached) and every reader told."""
        want, ready = self.want, self.ready
        return want is not None and ready is not None and not ready.pages and \
            self._reads >= want.readers

    def get_transfer_metric(self) -> Any:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric

        res = self.result
        if res is None or res is True:
            return KVTransferMetric()
        return KVTransferMetric(transfer_latency_s=res.seconds, transfer_total_bytes=res.bytes)

    def clear(self) -> None:
        with self.kv_mgr._lock:
            if self.kv_mgr.senders.get(self.room) is self:
                del self.kv_mgr.senders[self.room]
