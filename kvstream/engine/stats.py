"""What an agent reports about itself: a snapshot of its book and pools."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvstream.engine.book import Kind

if TYPE_CHECKING:
    from kvstream.engine.core import Core

__all__ = ["AgentStatistics", "snapshot"]


class AgentStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What an agent holds and has done; at rest every ``*_active`` figure is 0."""

    instance_id: str
    transfers_active: int
    reservations_active: int
    kv_registered_bytes: int
    staging_bytes_in_use: int
    staging_bytes_peak: int
    completed: int
    failed: int
    aborted: int
    timed_out: int
    bytes_sent: int
    bytes_received: int
    malformed_messages: int
    peers_alive: int
    staged_transfers: int = 0  # pushes held in staging, waiting for their reservation
    staged_dropped: int = 0  # ... that ended without one
    held_active: int = 0  # offers held for a pull (source side)
    leases_active: int = 0  # leases this agent keeps renewing (destination side)
    expired: int = 0  # offers released because nobody renewed their lease
    renewals_sent: int = 0
    bytes_skipped: int = 0  # already at the destination (incremental)
    peers_refused: int = 0  # instances not registered: the registry was full of live ones
    # Messages dropped unread: unsigned, a bad signature, or a key that is not the named
    # instance's (a forgery, or a restart before the old incarnation timed out).
    unauthenticated_messages: int = 0
    # Signed requests refused: about someone else's transfer, or an offer without its
    # secret (a pull, renewal or abort by a third party).
    forbidden_requests: int = 0
    data_discarded: int = 0  # data-plane messages on no live tag, dropped unread
    # Data-plane headers or credits whose MAC failed (not from the transfer's peer): the
    # transfer they claimed fails (a header) or ignores them (a credit).
    forged_frames: int = 0
    # Data-plane frames (a header each: one per layer, or one per short transfer) and the
    # copy jobs the streams ran (gathers, scatters, reads of a peer's memory), both sides.
    frames_sent: int = 0
    frames_received: int = 0
    copy_jobs: int = 0
    # Pushes nobody reserved, refused "busy": past their share of the staging pool or of
    # the transfer table (all of them), and of those, past one sender's share.
    refused_unsolicited: int = 0
    refused_unsolicited_sender: int = 0
    # Transfers started per data-plane path (dataplane/paths.py), e.g. {"shm": 3}.
    paths: dict[str, int] = {}

    def counts(self) -> dict[str, int]:
        """One flat dict of counts (what a sidecar sends): ``paths`` as ``path.<name>``."""
        out = {f: getattr(self, f) for f in self.__struct_fields__
               if isinstance(getattr(self, f), int)}
        out.update({f"path.{k}": v for k, v in self.paths.items()})
        return out


def snapshot(core: Core, malformed: int, unauthenticated: int = 0) -> AgentStatistics:
    book, c = core.book, core.book.counts
    kinds = [e.kind for e in book.live]
    return AgentStatistics(
        instance_id=core.instance_id,
        transfers_active=len(book.streams),
        reservations_active=kinds.count(Kind.RESERVATION),
        # Offers waiting for a pull (a shared one being read is its readers' transfers).
        held_active=sum(e.kind is Kind.OFFER and all(c.finished for c in e.children)
                        for e in book.live),
        leases_active=kinds.count(Kind.LEASE),
        staged_transfers=kinds.count(Kind.STAGED),
        kv_registered_bytes=core.memory.nbytes if core.memory else 0,
        staging_bytes_in_use=core.staging.in_use,
        staging_bytes_peak=core.staging.peak,
        malformed_messages=malformed,
        peers_alive=len(core.registry.instances()), peers_refused=core.registry.refused,
        completed=c["completed"], failed=c["failed"], aborted=c["aborted"],
        timed_out=c["timed_out"], expired=c["expired"], bytes_sent=c["bytes_sent"],
        bytes_received=c["bytes_received"], bytes_skipped=c["bytes_skipped"],
        staged_dropped=c["staged_dropped"], renewals_sent=c["renewals_sent"],
        unauthenticated_messages=unauthenticated, forbidden_requests=c["forbidden"],
        data_discarded=c["data_discarded"], forged_frames=c["forged_frames"],
        frames_sent=c["frames_sent"], frames_received=c["frames_received"],
        copy_jobs=c["copy_jobs"],
        refused_unsolicited=c["refused_unsolicited"],
        refused_unsolicited_sender=c["refused_unsolicited_sender"],
        paths={k[5:]: v for k, v in c.items() if k.startswith("path:")},
    )
