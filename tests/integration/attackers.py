"""The attackers of test_attacks_bus.py, each in its own process, as an attacker runs them.

* A *sniffer* is a plain nats-py connection subscribed to ``>`` on the pair's server (a
  NATS account without per-subject permissions lets any client read every subject). It
  decodes what it sees with ``kvstream.control.messages.decode`` and ignores what does
  not decode.
* An *insider* is a legitimate kvstream Agent with its own key and instance id, which
  the honest agents know and trust as itself (not as anyone else).

``run`` is the process body: one ``Plan`` picks the attack. The process says ``ready``
once it listens (and its agent sees the victim), waits for ``go`` where the attack needs
a cue, and puts one ``report`` (a dict) on the queue; it ends when ``stop`` is set.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = ["Plan", "constant_cache", "run"]

Mode = Literal["insider_push", "renew_sniffer", "data_injector", "reject_forger"]
FORGED_BYTE = 0x5A  # what injected layer data holds (no honest KV holds only this)
WAIT_S = 20.0  # the longest any step of an attack waits for what it needs


@dataclass(frozen=True)
class Plan:
    mode: Mode
    nats_url: str
    layout_blob: bytes
    victim: str  # the instance whose control subject the attack watches or targets
    request_id: str
    blocks: list[int] = field(default_factory=list)  # the attacker's own blocks
    insider_id: str = ""
    path: str = "ucx"  # data_injector: the data-plane path the pair is configured for
    nblocks: int = 2  # data_injector: blocks per layer, when no manifest is readable
    requests_seen: int = 3  # renew_sniffer: give up after this many unreadable requests
    # data_injector: a file the test writes the live Accept's fields to (msgpack: dst_tag,
    # dst_address, dst_tcp) before ``go``, as if they had leaked: the MACs must hold alone.
    leak_file: str = ""


def constant_cache(layout: Any, num_blocks: int, value: float) -> list[Any]:
    """An insider's own KV: unlike any honest (seeded random) KV."""
    import torch

    n = layout.num_layers * layout.tensors_per_layer
    return [torch.full(layout.tensor_shape(num_blocks), value, dtype=torch.float16)
            for _ in range(n)]


def run(plan: Plan, out_q: Any, go: Any, stop: Any) -> None:
    """The process body (spawned): the attack, then wait for ``stop``; no UCX teardown."""
    import faulthandler

    faulthandler.enable()
    logging.getLogger("kvstream").setLevel(logging.CRITICAL)  # refusals are expected
    try:
        asyncio.run(_ATTACKS[plan.mode](plan, out_q, go, stop))
    except BaseException as exc:  # say so: the test fails on a broken attacker, not hangs
        out_q.put(("report", {"error": f"{type(exc).__name__}: {exc}"}))
    os._exit(0)


async def _until(event: Any, timeout: float) -> bool:
    return await asyncio.to_thread(event.wait, timeout)


def _cfg(instance_id: str, nats_url: str) -> Any:
    from kvstream.config import AgentConfig

    return AgentConfig(instance_id=instance_id, nats_url=nats_url, heartbeat_s=0.25,
                       peer_timeout_s=1.0, request_timeout_s=1.0)


def _layout(plan: Plan) -> Any:
    from kvstream.layout import KVLayout

    return msgspec.msgpack.decode(plan.layout_blob, type=KVLayout)


async def _sees(agent: Any, instance_id: str) -> None:
    for _ in range(int(WAIT_S / 0.05)):
        if agent.registry.alive(instance_id):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{agent.instance_id} never saw {instance_id}")


class Sniffer:
    """Everything on the server, decoded where it decodes; requests to the victim and
    the answers on their reply subjects are noted (readable or not)."""

    def __init__(self, victim_subject: str) -> None:
        self.victim_subject = victim_subject
        self.counts: collections.Counter[str] = collections.Counter()
        self.requests: dict[str, Any] = {}  # reply subject -> the request, decoded or None
        self.answers: dict[str, Any] = {}  # reply subject -> the answer, decoded or None
        self.changed = asyncio.Event()
        self.hook: Any = None  # async (msg, decoded message or None) -> None

    async def start(self, nats_url: str) -> Any:
        import nats

        nc = await nats.connect(nats_url, name="sniffer")
        await nc.subscribe(">", cb=self._on_msg)
        await nc.flush()
        return nc

    async def _on_msg(self, msg: Any) -> None:
        from kvstream.control import messages as m

        self.counts["messages"] += 1
        try:
            decoded: Any = m.decode(msg.data)
            self.counts["decoded"] += 1
        except Exception:
            decoded = None
        if msg.subject == self.victim_subject and msg.reply:
            self.requests[msg.reply] = decoded
            self.counts["requests"] += 1
            self.counts["requests_read"] += decoded is not None
        elif msg.subject in self.requests:
            self.answers.setdefault(msg.subject, decoded)
            self.counts["answers"] += 1
            self.counts["answers_read"] += decoded is not None
        if decoded is not None and (getattr(decoded, "dst_tag", None) is not None
                                    or getattr(decoded, "src_tag", None) is not None):
            self.counts["tags_read"] += 1
        if self.hook is not None:
            await self.hook(msg, decoded)
        self.changed.set()

    async def until(self, cond: Any, timeout: float = WAIT_S) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not cond():
                    self.changed.clear()
                    await self.changed.wait()
        return bool(cond())


# == A: an insider pushes first ============================================================

async def _insider_push(plan: Plan, out_q: Any, go: Any, stop: Any) -> None:
    """Push the request's KV (the insider's own, constant) to the victim as soon as told:
    before the real prefill does."""
    from kvstream import KVStreamError
    from kvstream.engine.agent import Agent

    lay = _layout(plan)
    async with Agent(_cfg(plan.insider_id, plan.nats_url), layout=lay,
                     kv_caches=constant_cache(lay, 16, 7.0)) as agent:
        await _sees(agent, plan.victim)
        out_q.put(("ready", {}))
        await _until(go, WAIT_S)
        try:
            handle = await agent.push(plan.request_id, plan.victim, plan.blocks)
            handle.all_ready()
            async with asyncio.timeout(10):
                result = await handle.result()
            report = {"status": result.status.value, "reason": result.reason}
        except KVStreamError as exc:
            report = {"status": "refused", "reason": f"{type(exc).__name__}: {exc}"}
        except TimeoutError:
            report = {"status": "hung", "reason": ""}
        out_q.put(("report", report))
        await _until(stop, WAIT_S)


# == B: an offer's secret, sniffed off renewals, pulls, aborts ============================

async def _renew_sniffer(plan: Plan, out_q: Any, go: Any, stop: Any) -> None:
    """Collect the offer's secret from any Renew, Pull or Abort about the request, then
    pull the offer into the insider's own blocks with it (with "" if none was readable:
    the pull is tried either way)."""
    import torch

    from kvstream import KVStreamError
    from kvstream.control import messages as m
    from kvstream.control.subjects import Subjects
    from kvstream.engine.agent import Agent

    lay = _layout(plan)
    secrets: list[str] = []

    async def hook(msg: Any, decoded: Any) -> None:
        if isinstance(decoded, m.Renew):
            secrets.extend(s for rid, s in zip(decoded.request_ids, decoded.secrets, strict=False)
                           if rid == plan.request_id and s)
        elif isinstance(decoded, m.Pull | m.Abort) and decoded.request_id == plan.request_id \
                and decoded.secret:
            secrets.append(decoded.secret)

    kv = [torch.zeros(lay.tensor_shape(16), dtype=torch.float16)
          for _ in range(lay.num_layers * lay.tensors_per_layer)]
    sniffer = Sniffer(Subjects("default").control(plan.victim))
    sniffer.hook = hook
    nc = await sniffer.start(plan.nats_url)
    async with Agent(_cfg(plan.insider_id, plan.nats_url), layout=lay, kv_caches=kv) as agent:
        await _sees(agent, plan.victim)
        out_q.put(("ready", {}))
        await sniffer.until(lambda: secrets or sniffer.counts["requests"] >= plan.requests_seen)
        secret = secrets[0] if secrets else ""
        report: dict[str, Any] = {"secrets": len(secrets), **sniffer.counts}
        try:
            rx = await agent.pull(plan.request_id, plan.victim, plan.blocks, secret=secret)
            async with asyncio.timeout(10):
                result = await rx.result()
            report.update(status=result.status.value, reason=result.reason)
        except KVStreamError as exc:
            report.update(status="refused", reason=f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            report.update(status="hung", reason="")
        report["got"] = any(bool(t.any()) for t in kv)  # any byte of the offer landed here
        out_q.put(("report", report))
        await _until(stop, WAIT_S)
    await nc.close()


# == C: the Accept sniffed, layer data injected on its tag ================================

def _frame(plan: Plan, tag: int, layer: int, nbytes: int, single: bool) -> Any:
    """One forged layer as the honest sender frames it: ``[header | payload]`` in one
    message (``single``), else the header alone (the shm path reads the data itself)."""
    import numpy as np

    from kvstream.dataplane import wire

    header = wire.LayerHeader(tag, layer, nbytes, 1)
    if not single:
        hdr = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
        return hdr[:wire.encode_header(header, hdr.data)]
    buf = np.full(wire.HEADER_CAPACITY + nbytes, FORGED_BYTE, dtype=np.uint8)
    buf[:wire.HEADER_CAPACITY] = 0
    wire.encode_header(header, buf[:wire.HEADER_CAPACITY].data)
    return buf


async def _inject_ucx(plan: Plan, accept: Any, nbytes: int, layers: int) -> int:
    import ucxx

    from kvstream.dataplane import wire

    single = plan.path != "shm"
    kind = wire.KIND_DATA if single else wire.KIND_HEADER
    ep = await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(accept.dst_address), endpoint_error_handling=False)
    bufs = [_frame(plan, accept.dst_tag, layer, nbytes, single) for layer in range(layers)]
    sends = [asyncio.ensure_future(ep.send(buf, tag=wire.make_tag(accept.dst_tag, layer, kind),
                                           force_tag=True))
             for layer, buf in enumerate(bufs)]
    done, _ = await asyncio.wait(sends, timeout=10)
    return sum(1 for f in done if f.exception() is None)


def _inject_tcp(plan: Plan, accept: Any, nbytes: int, layers: int) -> int:
    from kvstream.dataplane import wire
    from kvstream.dataplane.tcp_conn import HEADER, MAGIC, parse_address

    host, port = parse_address(accept.dst_tcp)
    with socket.create_connection((host, port), timeout=5) as sock:
        for layer in range(layers):
            payload = _frame(plan, accept.dst_tag, layer, nbytes, True).tobytes()
            tag = wire.make_tag(accept.dst_tag, layer, wire.KIND_DATA)
            sock.sendall(HEADER.pack(MAGIC, 0, tag, len(payload)) + payload)
        with contextlib.suppress(OSError):  # let the reader take every frame before EOF
            sock.settimeout(1.0)
            sock.recv(1)
    return layers


def _leaked(plan: Plan) -> Any:
    """The Accept as the test leaked it (only the fields an injection needs)."""
    from kvstream.control import messages as m

    got = msgspec.msgpack.decode(Path(plan.leak_file).read_bytes())
    return m.Accept(transfer_id="leaked", dst_tag=got["dst_tag"],
                    dst_address=got["dst_address"], dst_blocks=[], dst_tcp=got["dst_tcp"])


async def _data_injector(plan: Plan, out_q: Any, go: Any, stop: Any) -> None:
    """Wait for the answer to a manifest sent to the victim; when it is a readable
    Accept (or the test leaks one), inject every layer on its tag, on the pair's path."""
    import ucxx

    from kvstream.control import messages as m
    from kvstream.control.subjects import Subjects
    from kvstream.quant.scheme import wire_layer_bytes

    ucxx.init(progress_mode="thread", enable_python_future=True)
    lay = _layout(plan)
    sniffer = Sniffer(Subjects("default").control(plan.victim))
    nc = await sniffer.start(plan.nats_url)
    out_q.put(("ready", {}))
    await sniffer.until(lambda: sniffer.counts["answers"] >= 1)
    report: dict[str, Any] = {"injected": 0}
    answers = list(sniffer.answers.items())
    if plan.leak_file:
        await _until(go, WAIT_S)
        answers = [("", _leaked(plan))]
    for reply, accept in answers:
        manifest = sniffer.requests.get(reply)
        if not isinstance(accept, m.Accept) or accept.dst_tag == 0:
            continue
        nblocks = plan.nblocks
        if isinstance(manifest, m.Manifest):
            nblocks = len(manifest.src_blocks) - len(accept.skip)
        nbytes = wire_layer_bytes(lay, "none", nblocks)
        try:
            if plan.path == "tcp":
                report["injected"] += await asyncio.to_thread(
                    _inject_tcp, plan, accept, nbytes, lay.num_layers)
            else:
                report["injected"] += await _inject_ucx(plan, accept, nbytes, lay.num_layers)
        except Exception as exc:
            report["inject_error"] = f"{type(exc).__name__}: {exc}"
    report.update(sniffer.counts)
    out_q.put(("report", report))
    await _until(stop, WAIT_S)
    await nc.close()


# == D: forged Rejects on a manifest's reply subject ======================================

async def _reject_forger(plan: Plan, out_q: Any, go: Any, stop: Any) -> None:
    """Answer every request to the victim with a Reject at once, on its reply subject:
    unsigned, and signed by the insider (a key the pair trusts, but not the victim's)."""
    from kvstream.control import messages as m
    from kvstream.control.subjects import Subjects
    from kvstream.engine.agent import Agent

    sniffer = Sniffer(Subjects("default").control(plan.victim))
    async with Agent(_cfg(plan.insider_id, plan.nats_url)) as agent:
        identity = agent._core.identity
        nc: Any = None

        async def hook(msg: Any, decoded: Any) -> None:
            if msg.subject != sniffer.victim_subject or not msg.reply:
                return
            tid = decoded.transfer_id if isinstance(decoded, m.Manifest) else ""
            data = m.encode(m.Reject(transfer_id=tid, code="incompatible",
                                     reason="forged by the sniffer"))
            await nc.publish(msg.reply, data)
            await nc.publish(msg.reply, data, headers=identity.seal(msg.reply, data))
            sniffer.counts["forged"] += 2

        sniffer.hook = hook
        nc = await sniffer.start(plan.nats_url)
        await _sees(agent, plan.victim)
        out_q.put(("ready", {}))
        await _until(stop, WAIT_S)
        out_q.put(("report", dict(sniffer.counts)))
    await nc.close()


_ATTACKS = {"insider_push": _insider_push, "renew_sniffer": _renew_sniffer,
            "data_injector": _data_injector, "reject_forger": _reject_forger}
