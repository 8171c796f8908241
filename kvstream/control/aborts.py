"""Asking an instance to stop something: a running transfer by id, or a held offer by
request id.

Agents use ``request_abort`` for their own transfers and leases; ``release_offer`` is the
same message for a party that owns no agent (``kvstream proxy``): it tells a prefill
instance that nobody will pull ``request_id``, so its blocks are freed now instead of when
the lease runs out.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstream._exceptions import KVStreamError
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects

if TYPE_CHECKING:
    from kvstream.control.port import ControlPort

__all__ = ["release_offer", "request_abort"]

log = logging.getLogger("kvstream.control")


async def request_abort(bus: ControlPort, subjects: Subjects, peer: str, *, reason: str, by: str,
                        timeout: float, transfer_id: str = "", request_id: str = "",
                        secret: str = "") -> bool:
    """Send an ``Abort`` to ``peer``'s control subject and wait (at most ``timeout``) for its
    ``AbortAck``, which it sends once nothing of that transfer is in flight there.

    Returns False when the peer did not acknowledge (gone, slow, refused): the abort is
    best effort, since the peer's own deadlines end the transfer anyway (a ``peer`` that is
    no valid instance id is one more way of not answering). ``secret``: the offer's, when
    the abort names an offer by request id.
    """
    msg = m.Abort(transfer_id=transfer_id, request_id=request_id, reason=reason, by=by,
                  secret=secret)
    try:
        reply = await bus.request(subjects.control(peer), msg, timeout=timeout, peer=peer)
    except KVStreamError as exc:
        log.info("abort of %s not acknowledged by %s: %s", transfer_id or request_id, peer, exc)
        return False
    return isinstance(reply, m.AbortAck)


async def release_offer(bus: ControlPort, namespace: str, src_instance: str, request_id: str,
                        reason: str, *, by: str = "kvstream", timeout: float = 2.0,
                        secret: str = "") -> bool:
    """Tell ``src_instance`` to drop the offer it holds for ``request_id`` at once.

    For whoever routed the request when its decode side failed before it could pull (the
    proxy): the source ends the offer ``aborted`` and frees its blocks, instead of waiting
    for the lease to expire. ``by`` names the sender in the offer's reason; ``secret`` is
    the offer's (from its ``kv_transfer_params``) and ``bus`` must sign as ``by``
    (``bus.seal``), or the source refuses. A pull already
    running is not stopped by this (only its puller can abort it). Returns True once the
    source acknowledged; False if it did not answer within ``timeout``.
    """
    return await request_abort(bus, Subjects(namespace), src_instance, reason=reason, by=by,
                               timeout=timeout, request_id=request_id, secret=secret)
