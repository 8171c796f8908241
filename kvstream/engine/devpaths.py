"""The agent's ``cuda_ipc`` side: what device KV it offers same-host peers, whose it opens.

A source exports its registered device KV (``DeviceExport``: one IPC handle per layer, a
fresh epoch per registration) and announces only the ``DeviceOffer`` (whose, which
registration, which GPU). The handles are a capability (read and write), so they go only
in the manifest of one transfer, to a peer the registry says is on this host, in
another process, offering CUDA IPC itself. A destination opens a peer's export only if
it is the one that peer announces (pid and epoch: a peer cannot name a third party's
memory as its own, nor an old registration of its own), the GPU is visible here and
reachable from ours (same GPU or P2P), and opening it has not failed before for that
registration. Openings are shared and bounded (``PeerDevMaps``) and closed once unused
after the peer's registration changes, it leaves or goes silent.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import TYPE_CHECKING

import anyio

from kvstream import cuda_ipc
from kvstream._exceptions import DataPlaneError, KVStreamError, ProtocolError
from kvstream.cuda_ipc import DeviceExport, DeviceOffer
from kvstream.dataplane.peerdev import PeerDevKV, PeerDevMaps

if TYPE_CHECKING:
    from kvstream.control.messages import Announce
    from kvstream.memory import RegisteredKV

__all__ = ["DeviceIpc"]

log = logging.getLogger("kvstream.agent")


def ordinal(mem: RegisteredKV) -> int:
    if mem.device.index is not None:
        return int(mem.device.index)
    import torch

    return int(torch.cuda.current_device())


class DeviceIpc:
    def __init__(self, instance_id: str, max_peers: int = 256) -> None:
        self.instance_id = instance_id
        self.maps = PeerDevMaps(max_peers=max_peers)
        self.export: DeviceExport | None = None
        self._opened: dict[str, DeviceOffer] = {}  # peer -> the registration we opened
        self._failed: dict[str, DeviceOffer] = {}  # peer -> the registration that failed

    # -- the source --------------------------------------------------------------------
    def register(self, mem: RegisteredKV) -> None:
        self.export = None
        self.maps.use_device(ordinal(mem))
        try:
            self.export = DeviceExport(pid=os.getpid(), num_blocks=mem.num_blocks,
                                       layers=[cuda_ipc.export_tensor(t) for t in mem.layers],
                                       epoch=secrets.randbits(62))
        except Exception as exc:  # cupy missing, an allocator without handles, a driver error
            log.info("%s: device KV not offered over CUDA IPC (%s)", self.instance_id, exc)

    def unregister(self) -> None:
        self.export = None

    @property
    def offer(self) -> DeviceOffer | None:
        return self.export.offer if self.export is not None else None

    def handles_for(self, peer: Announce | None, same_host: bool) -> DeviceExport | None:
        """Our handles for one transfer to ``peer`` (its announcement), if it may have them."""
        if self.export is None or peer is None or not same_host or peer.cuda_ipc is None \
                or peer.cuda_ipc.pid == os.getpid():
            return None
        return self.export

    # -- the destination ---------------------------------------------------------------
    def reachable(self, gpu: bytes) -> bool:
        """Is the peer's GPU visible here and readable from ours?"""
        if not gpu:
            return False
        gpus = cuda_ipc.visible_gpus()
        return gpu in gpus and cuda_ipc.can_read(self.maps.device, gpus.index(gpu))

    def may_open(self, peer: str, offer: DeviceOffer | None) -> bool:
        return offer is not None and offer.pid != os.getpid() and \
            self._failed.get(peer) != offer and self.reachable(offer.gpu)

    def announced(self, export: DeviceExport, offer: DeviceOffer | None) -> bool:
        """Is ``export`` the registration its sender announces?"""
        return offer is not None and export.offer == offer

    async def open(self, peer: str, export: DeviceExport, mem: RegisteredKV) -> PeerDevKV:
        """Open a same-host peer's announced device KV (on a thread: the driver maps it)."""
        before = self._opened.get(peer)
        if before is not None and before != export.offer:
            self.forget(peer)  # a new registration: what we opened of the old goes
        if peer not in self._opened and len(self._opened) >= self.maps.max_peers:
            self.forget(next(iter(self._opened)))
        self._opened[peer] = export.offer
        try:
            return await anyio.to_thread.run_sync(
                self.maps.acquire, export, export.num_blocks * mem.layout.block_bytes,
                mem.layout.num_layers)
        except (DataPlaneError, ProtocolError):
            # CUDA refused or the handles are bad (another IPC namespace, no P2P): that
            # registration is not tried again; the peer's transfers take UCX.
            if peer not in self._failed and len(self._failed) >= self.maps.max_peers:
                self._failed.pop(next(iter(self._failed)))
            self._failed[peer] = export.offer
            raise
        except KVStreamError:
            raise  # a bound reached, a layout mismatch: not the peer's registration's fault

    def changed(self, peer: str, before: DeviceOffer | None, now: DeviceOffer | None) -> None:
        """The peer announced another registration (or none): close what we opened."""
        if before != now:
            self.forget(peer)

    def forget(self, peer: str) -> None:
        offer = self._opened.pop(peer, None)
        self._failed.pop(peer, None)
        if offer is not None:
            self.maps.drop_if(lambda export: export.offer == offer)

    def prune(self, live_peers: set[str]) -> None:
        for peer in [p for p in self._opened if p not in live_peers]:
            self.forget(peer)
        for peer in [p for p in self._failed if p not in live_peers]:
            del self._failed[peer]

    def close(self) -> None:
        self._opened.clear()
        self.maps.drop()
