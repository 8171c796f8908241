"""Push legs (``transfer="push"``): both legs at once, the prefill pushes into the decode.

One job: decide whether a prefill and a decode engine can take a layer-pipelined push (both
announce every TP rank, equal TP degree and equal KV layout: the connector pushes between
equal ranks only) and write the two legs' ``kv_transfer_params`` that name each to the
other (``kvstream.adapters.vllm.push`` reads them), and tell the decode ranks when the
prefill leg failed.
"""

from __future__ import annotations

import logging
import re
import secrets
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from kvstream._exceptions import KVStreamError
from kvstream.control.push_notes import note_message

if TYPE_CHECKING:
    from kvstream.control.bus import ControlBus
    from kvstream.control.registry import Registry
    from kvstream.control.subjects import Subjects
    from kvstream.routing.directory import Instance

__all__ = ["PushPlan", "decode_params", "decode_ranks", "note_failed", "prefill_push",
           "push_plan"]

log = logging.getLogger("kvstream.proxy")

_RANK = re.compile(r"(.+)-tp(\d+)")


class PushPlan(msgspec.Struct, frozen=True, kw_only=True):
    prefill: str        # the prefill engine's instance id (its ranks add "-tp<r>")
    decode: str
    tp_size: int
    block_size: int
    push_id: str
    secret: str


def _engine(ids: tuple[str, ...], registry: Registry) -> tuple[str, int, str, int] | None:
    """(engine id, TP degree, layout fingerprint, block size) of an engine whose every
    rank announces alike, else None."""
    anns = [registry.announced(i) for i in ids]
    if not anns or any(a is None or a.layout is None for a in anns):
        return None
    sizes = {a.tp.size if a.tp else 1 for a in anns if a is not None}
    prints = {a.layout.fingerprint for a in anns if a is not None and a.layout is not None}
    if len(sizes) != 1 or len(prints) != 1:
        return None
    tp = sizes.pop()
    if tp != len(ids):
        return None  # a rank is missing: it could not take (or send) its share
    if tp == 1:
        base = ids[0]
    else:
        bases = {m.group(1) for i in ids if (m := _RANK.fullmatch(i))}
        ranks = sorted(int(m.group(2)) for i in ids if (m := _RANK.fullmatch(i)))
        if len(bases) != 1 or ranks != list(range(tp)):
            return None
        base = bases.pop()
    first = anns[0]
    assert first is not None and first.layout is not None
    return base, tp, prints.pop(), first.layout.block_size


def push_plan(p: Instance, d: Instance, registry: Registry) -> PushPlan | None:
    """A push from ``p`` into ``d``, or None when they are not equal engines (then pull)."""
    pe, de = _engine(p.instance_ids, registry), _engine(d.instance_ids, registry)
    if pe is None or de is None or pe[1:] != de[1:] or pe[0] == de[0]:
        return None
    return PushPlan(prefill=pe[0], decode=de[0], tp_size=pe[1], block_size=pe[3],
                    push_id=f"push-{uuid.uuid4().hex}", secret=secrets.token_urlsafe(16))


def prefill_push(body: dict[str, Any], plan: PushPlan) -> dict[str, Any]:
    """The P leg's body (``prefill_body``'s) asking its engine to push to the decode."""
    params = dict(body["kv_transfer_params"])
    params["kvstream"] = {"push_to": plan.decode, "push_id": plan.push_id, "secret": plan.secret}
    return {**body, "kv_transfer_params": params}


def decode_params(plan: PushPlan, by: str = "") -> dict[str, Any]:
    """The D leg's ``kv_transfer_params``: expect the push (NIXL's keys, as a prefill's);
    ``by``: the proxy, whose signed "failed" note the decode ranks heed too."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": plan.prefill, "remote_request_id": plan.push_id,
            "remote_block_ids": [[]], "remote_host": "", "remote_port": 0,
            "tp_size": plan.tp_size, "transfer_mode": "push",
            "kvstream": {"push": True, "instance": plan.prefill, "secret": plan.secret,
                         "block_size": plan.block_size, "by": by}}


def decode_ranks(plan: PushPlan) -> list[str]:
    """The instance ids of the decode engine's ranks (each expects its share)."""
    if plan.tp_size == 1:
        return [plan.decode]
    return [f"{plan.decode}-tp{r}" for r in range(plan.tp_size)]


async def note_failed(bus: ControlBus, subjects: Subjects, plan: PushPlan, reason: str, *,
                      offered: bool = True) -> None:
    """Tell every decode rank the push will not come (the prefill leg failed before its
    engine's ranks could say so themselves): they pull or recompute now instead of waiting
    out their reservations; ``offered=False`` (the prefill engine was never reached, so
    nothing was offered): they recompute without trying a pull. Best effort: a lost note
    leaves that bound."""
    msg = note_message(plan.push_id, "failed", reason, offered=offered)
    for inst in decode_ranks(plan):
        try:
            await bus.publish(subjects.control(inst), msg, peer=inst)
        except KVStreamError as exc:
            log.warning("noting push %s failed to %s: %s", plan.push_id, inst, exc)
