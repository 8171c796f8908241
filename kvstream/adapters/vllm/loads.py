"""The decode's loads, in the worker role of ``KVStreamConnector``: for each request the
scheduler hands over, keep the prefill ranks' holds while it queues, then pull (or take
the push of) its blocks from one rank or a gather of several, release every hold it did
not use, and report the load to vLLM exactly once, whatever failed. ``WorkerSide``
(``worker.py``) adds the registration, the offers and the results vLLM polls."""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING

from kvstream._exceptions import AdapterError, KVStreamError
from kvstream.adapters.vllm import ranks
from kvstream.adapters.vllm.common import CPU_CONVERTS, CPU_REFUSAL, PullJob, Remote, Side, log
from kvstream.adapters.vllm.push import NoPush, send_note
from kvstream.engine.rules import needs_reshape
from kvstream.transfer.gathered import GatherHandle
from kvstream.transfer.plan import TpInfo

if TYPE_CHECKING:
    from kvstream.adapters.runtime import AgentRuntime
    from kvstream.adapters.vllm.push import DecodePushes
    from kvstream.engine.agent import Agent
    from kvstream.layout import KVLayout
    from kvstream.transfer import TransferResult
    from kvstream.transfer.handles import ReceiveHandle

__all__ = ["Loads"]


class _Done(Exception):
    """The push delivered the load (or it was cancelled): no pull (internal)."""


class Loads(Side):
    """The worker's decode side: its loads, on the agent's loop (set up by ``WorkerSide``)."""

    _runtime: AgentRuntime | None
    _tp_rank: int
    _tp: TpInfo
    _layout: KVLayout | None
    _results: queue.SimpleQueue[tuple[str, str, bool, list[int]]]  # to vLLM, once each
    _pulls: dict[str, ReceiveHandle | GatherHandle | None]  # running loads
    _cancelled: set[str]  # loads whose decode request ended
    _incoming: DecodePushes | None  # the pushes awaited (push.py)

    def _owned(self, remote: Remote) -> list[str]:
        """The prefill ranks whose holds this rank keeps, pulls or releases."""
        return [ranks.instance(remote.instance, p, remote.tp_size)
                for p in ranks.owned(self._tp_rank, remote.tp_size, self._tp_size)]

    def _sources(self, remote: Remote) -> list[str]:
        """The prefill ranks holding this rank's KV heads (the scheduler checked they can)."""
        return [ranks.instance(remote.instance, p, remote.tp_size)
                for p in ranks.sources(self._tp_rank, remote.tp_size, self._tp_size)]

    def _refusal(self, agent: Agent, job: PullJob, sources: list[str]) -> str | None:
        """Why this load must not run after all, from what the sources announce (their
        layouts; the params told the scheduler only block size, TP degree and device)."""
        mine = self._layout
        announced = {a.instance_id: a for a in agent.peers()}
        reshaped = len(sources) > 1  # a gather converts
        for src in sources:
            ann = announced.get(src)
            if ann is None or ann.layout is None or mine is None:
                continue  # the engine finds out (and refuses) itself
            theirs = ann.layout
            # Only whole head regions of equal blocks move as they lie; anything converted
            # is read through the layout probed for these dtypes.
            as_they_lie = theirs.arrangement == mine.arrangement == "cpu_hnbc" and \
                theirs.block_size == mine.block_size
            if "cpu_hnbc" in (theirs.arrangement, mine.arrangement) and not as_they_lie and \
                    not {theirs.dtype, mine.dtype} <= CPU_CONVERTS:
                return (f"{src} registers block size {theirs.block_size}, this rank "
                        f"{mine.block_size}: {CPU_REFUSAL}")
            reshaped = reshaped or needs_reshape(theirs, ann.tp or TpInfo(), mine, self._tp)
        if reshaped and job.local:
            # The engine would convert the whole prompt, into the shared blocks this
            # engine's prefix cache supplied too (scheduler.py, _refusal, says why not).
            return (f"{','.join(sources)} holds another layout and {job.local} blocks here "
                    "came from the prefix cache: the load would rewrite them")
        return None


    async def _keep(self, src: str, rrid: str, secret: str) -> None:
        agent = self._runtime.agent if self._runtime else None
        if agent is None:
            return
        try:
            await agent.keep(rrid, src, secret)
        except KVStreamError as exc:
            log.warning("keeping %s at %s failed (the pull will report it): %s", rrid, src, exc)

    async def _release(self, src: str, rrid: str, reason: str, secret: str, *,
                       push: bool = False) -> None:
        agent = self._runtime.agent if self._runtime else None
        if agent is None:
            return
        if push:  # the prefill may not have offered yet: it must not push either
            await send_note(agent, src, rrid, "declined", reason)
        try:
            await agent.release(rrid, src, reason, secret)
        except KVStreamError as exc:  # a bad instance id: the hold expires with its lease
            log.warning("releasing %s at %s failed: %s", rrid, src, exc)
        self._events("released", src=src, remote_request_id=rrid, reason=reason)

    async def _pull(self, rid: str, job: PullJob) -> None:
        agent = self._runtime.agent if self._runtime else None
        remote, blocks, local = job.remote, job.blocks, job.local
        rrid, sources = remote.request_id, self._sources(remote)
        src = ",".join(sources)
        res: TransferResult | None = None
        why, let_go, via, push_why = "", False, "pull", ""
        try:
            if agent is None:
                raise AdapterError("agent closed")
            refused = self._refusal(agent, job, sources)
            if refused is not None:  # a failed load: vLLM computes from the first uncached block
                let_go = True
                for held in self._owned(remote):
                    await self._release(held, rrid, f"the decode side declined the load: "
                                        f"{refused}", remote.secret, push=remote.push)
                raise AdapterError(refused)
            if remote.push:
                via = "push"
                offered = True
                try:
                    res = await self._take_push(agent, rid, job, sources[0])
                    failed = res.reason
                except NoPush as exc:
                    res, failed, offered = None, str(exc), exc.offered
                except KVStreamError as exc:  # e.g. a staged push that cannot skip
                    res, failed = None, str(exc)
                if res is not None and (res.ok or rid in self._cancelled):
                    if res.ok:  # the prefill keeps its offer until told
                        await self._release(sources[0], rrid, "pushed", remote.secret)
                    raise _Done
                push_why = failed
                if not offered or not agent.registry.alive(sources[0]):
                    # Nothing to pull: the prefill engine never had the request, or it is
                    # gone (a pull would wait for its answer). vLLM recomputes now.
                    raise AdapterError(f"no push, and no offer to pull: {failed}")
                via = "push, then pull"
                log.info("kvstream load %s: the push from %s failed (%s): pulling its offer",
                         rid, src, failed)
                res = None
            # ``tokens``: how many the blocks are to hold, for a source of another block
            # size (ignored between equal layouts). Several sources: one gather of heads.
            # Decode TP above prefill TP: the decode ranks sharing a prefill rank each
            # pull their heads of its one offer (``readers`` of it).
            shared = ranks.readers(ranks.sources(self._tp_rank, remote.tp_size,
                                                 self._tp_size)[0], remote.tp_size,
                                   self._tp_size)
            handle = await agent.pull(rrid, sources[0] if len(sources) == 1 else sources,
                                      blocks, mode="eager", have=job.have,
                                      codec=job.codec if len(sources) == 1 else "none",
                                      secret=remote.secret, tokens=job.tokens,
                                      readers=shared if len(sources) == 1 else 1)
            self._pulls[rid] = handle
            if rid in self._cancelled:
                await handle.abort("the decode request ended")
            if isinstance(handle, GatherHandle):  # replicas the plan did not use: free now
                used = {part.transfer.peer for part in handle.parts}
                for held in self._owned(remote):
                    if held not in used:
                        await self._release(held, rrid, "its heads came from another rank",
                                            remote.secret)
            res = await handle.result()
            why = res.reason
        except _Done:
            why = res.reason if res is not None else ""
        except Exception as exc:  # vLLM must hear of every load, whatever failed
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self._pulls.pop(rid, None)
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
        ok = res is not None and res.ok
        if not ok and agent is not None and not let_go and not cancelled:
            # A pull that failed before its source answered leaves the kept leases
            # renewed; a gather's other ranks and replicas too: let every hold go (a hold
            # a transfer took over is ended already, the release is then a no-op).
            for held in self._owned(remote):
                await self._release(held, rrid, f"the load failed: {why}"[:200], remote.secret,
                                    push=remote.push)
        elif cancelled and remote.push and agent is not None:
            for held in self._owned(remote):  # the prefill may not have pushed yet
                await self._release(held, rrid, "the decode request ended", remote.secret,
                                    push=True)
        if cancelled:
            log.info("kvstream load %s aborted: the decode request ended (from %s, request %s)",
                     rid, src, rrid)
        elif not ok:
            log.warning("kvstream load %s from %s (request %s) failed: %s; blocks=%d; vLLM %s",
                        rid, src, rrid, why or "no reason given", len(blocks) - local,
                        self._on_load_failure())
        elif res is not None:
            # One line per load, never per layer: what moved, how fast, from where.
            log.info("kvstream load %s from %s (request %s%s): blocks=%d cached_blocks=%d "
                     "bytes=%d ms=%.1f codec=%s", rid, src, rrid,
                     "" if via == "pull" else f", {via}", len(blocks) - local, local,
                     res.bytes, res.seconds * 1e3, res.codec)
        self._events("pull_ended", request_id=rid, src=src, remote_request_id=rrid, ok=ok, via=via,
                     reason=why, push_reason=push_why, bytes=res.bytes if res else 0,
                     skipped=res.bytes_skipped if res else 0, codec=res.codec if res else "",
                     seconds=res.seconds if res else 0.0, blocks=len(blocks), local_blocks=local,
                     sources=sources, tokens=job.tokens)
        self._results.put(("recv", rid, ok, blocks[local:]))

    async def _take_push(self, agent: Agent, rid: str, job: PullJob, src: str
                         ) -> TransferResult:
        if self._incoming is None:
            raise AdapterError("KV caches not registered with KVStreamConnector")

        async def started(handle: ReceiveHandle) -> None:
            self._pulls[rid] = handle
            if rid in self._cancelled:
                await handle.abort("the decode request ended")

        return await self._incoming.take(agent, job.remote.request_id, job.blocks, job.have,
                                         src, started, by=job.remote.by)

    def _on_load_failure(self) -> str:
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") == "recompute":
            return "recomputes the prompt"
        return "fails the request (kv_load_failure_policy 'fail')"

    async def _abort_pull(self, rid: str) -> None:
        if rid not in self._pulls:
            return
        self._cancelled.add(rid)
        handle = self._pulls.get(rid)
        if handle is not None:
            await handle.abort("the decode request ended")

