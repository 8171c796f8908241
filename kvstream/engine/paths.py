"""The agent's data-plane paths: what it offers peers, which one a transfer takes.

The destination picks (``choose``: it knows whether it could map the source's memory);
the source checks the pick against what it offers that peer (``refusal``). Both record
the path on the transfer (``Transfer.path``: result, statistics, span).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio

from kvstream import shm
from kvstream._exceptions import KVStreamError, LayoutError, ProtocolError
from kvstream.cuda_ipc import DeviceExport, DeviceOffer
from kvstream.dataplane.paths import choose, host_identity, label, rdma_present
from kvstream.dataplane.peerdev import PeerDevKV
from kvstream.dataplane.peermem import MapCache, Mapped, MappedSource, PeerKV, PeerMaps
from kvstream.engine.devpaths import DeviceIpc, ordinal

if TYPE_CHECKING:
    from kvstream.config import AgentConfig
    from kvstream.control.registry import Registry
    from kvstream.dataplane.tcp import TcpTransport
    from kvstream.dataplane.transport import Transport
    from kvstream.memory import RegisteredKV
    from kvstream.transfer.state import Transfer

__all__ = ["Choice", "DataPaths"]

log = logging.getLogger("kvstream.agent")


class Choice:
    """A destination's pick: the path, and the source's mapped memory if it is ``shm`` or
    ``cuda_ipc`` (a pull's ``cuda_ipc`` opens it once the manifest names it: ``open``)."""

    def __init__(self, path: str, maps: MapCache[Any], kv: Mapped | None, tcp: bytes,
                 paths: DataPaths | None = None) -> None:
        self.path, self.tcp = path, tcp
        self._maps, self._kv = maps, kv
        self._paths = paths

    def holds(self, proofs: list[bytes], src: str, dst: str, transfer_id: str) -> bool:
        """Does the sender hold the mapped source (``PeerKV.holds``)?"""
        return isinstance(self._kv, PeerKV) and \
            self._kv.holds(proofs, shm.proof_context(src, dst, transfer_id))

    async def open(self, peer: str, export: DeviceExport | None, offer: DeviceOffer | None,
                   mem: RegisteredKV) -> None:
        """A pull's ``cuda_ipc``: open the handles the source's manifest names, if they
        are the registration it announces (``offer``). Raises ``ProtocolError`` (none
        named, or not the announced) or the opener's error (the transfer then fails)."""
        if export is None or self._paths is None or \
                not self._paths.ipc.announced(export, offer):
            raise ProtocolError(f"{peer} answered on cuda_ipc without the device KV it "
                                "announces")
        self.release()
        self._kv = await self._paths.ipc.open(peer, export, mem)

    def refusal(self, src_ids: list[int]) -> str | None:
        """Why the source's block ids cannot be read from its mapped memory, if so."""
        if self._kv is None:
            return None
        n = self._kv.export.num_blocks
        bad = [b for b in src_ids if not 0 <= b < n]
        return f"source block ids {bad[:8]} outside {n} shared blocks" if bad else None

    def source(self, src_ids: list[int], mem: RegisteredKV) -> MappedSource | None:
        """The stream's reads out of the mapped source (it releases the mapping when its
        transfer ends); ``LayoutError`` if the ids are outside the source's blocks, or the
        source was opened for another GPU than ``mem``'s (re-registered meanwhile)."""
        kv, self._kv = self._kv, None
        if kv is None:
            return None
        try:
            if isinstance(kv, PeerDevKV) and kv.device != ordinal(mem):
                raise LayoutError(f"the source's KV was opened for GPU {kv.device}, "
                                  f"this memory is on {mem.device}")
            return MappedSource(self._maps, kv, src_ids, planes=mem.planes,
                                chunk_bytes=mem.layout.chunk_bytes)
        except LayoutError:
            self._maps.release(kv)
            raise

    def release(self) -> None:
        kv, self._kv = self._kv, None
        if kv is not None:
            self._maps.release(kv)


class DataPaths:
    def __init__(self, config: AgentConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.host = host_identity(config.host_id)
        self.maps = PeerMaps()
        self.ipc = DeviceIpc(config.instance_id)
        self.tcp: TcpTransport | None = None
        self.shared: shm.SharedExport | None = None
        self.device = "cpu"

    @property
    def tcp_address(self) -> bytes:
        """Offered for host KV only (the socket moves host memory; device KV takes UCX)."""
        if self.tcp is None or self.device != "cpu":
            return b""
        return self.tcp.address

    def tcp_token(self, peer: str) -> bytes:
        """The token ``peer`` connects to our TCP data port with (b"": we offer no port).
        It travels only in boxed messages to that peer."""
        if self.tcp is None or not self.tcp_address:
            return b""
        return self.tcp.token_for(peer)

    def trust_tcp(self, peer: str, address: bytes, token: bytes) -> None:
        """Connect to ``peer``'s TCP data port (``address``) with the token it issued us.
        ``ProtocolError`` without a well-formed one: its port would refuse us."""
        if self.tcp is None or not token:
            raise ProtocolError(f"{peer} gave no token for its TCP data port")
        self.tcp.set_credentials(address, self.config.instance_id, token)

    def register(self, mem: RegisteredKV) -> None:
        """Export the memory to same-host peers if it lives in shared segments."""
        self.shared = None
        self.ipc.unregister()
        self.device = mem.device.type
        # The mapped paths read a peer's layer as one region: a split layout's K and V
        # are two, so it moves by UCX or TCP.
        mapped = not mem.layout.split
        if "shm" in self.config.paths and mem.device.type == "cpu" and mapped:
            self.shared = shm.export(mem.layers, mem.num_blocks)
        if "cuda_ipc" in self.config.paths and mem.device.type == "cuda" and mapped:
            self.ipc.register(mem)
        if mem.device.type == "cuda" and not rdma_present():
            log.warning("%s: device KV registered on a host without RDMA devices: transfers "
                        "to other hosts go over UCX's TCP transport (staged through host "
                        "memory, a fraction of the link's speed)", self.config.instance_id)

    def proofs(self, dst: str, transfer_id: str) -> list[bytes]:
        """That we hold our segments, for one destination and transfer (``shm.proofs_of``)."""
        if self.shared is None:
            return []
        return shm.proofs_of(self.shared, shm.proof_context(self.config.instance_id, dst,
                                                            transfer_id))

    def unregister(self) -> None:
        self.shared = None
        self.ipc.unregister()

    def device_for(self, peer: str, path: str = "cuda_ipc", codec: str = "none"
                   ) -> DeviceExport | None:
        """Our device KV's handles for one transfer to ``peer``, if it is on this host (as
        the registry knows it), in another process and offers CUDA IPC itself."""
        if path != "cuda_ipc" or codec != "none":
            return None
        ann = self.registry.announced(peer)
        return self.ipc.handles_for(ann, ann is not None and self.same_host(ann.host))

    def same_host(self, peer_host: str) -> bool:
        return bool(self.host) and peer_host == self.host

    def check_tcp(self, peer: str, address: bytes) -> bytes:
        """A peer's TCP data address, refused unless well-formed and the one it announces."""
        if self.tcp is None or not address:
            return b""
        self.tcp.check_address(address)
        announced = self.registry.announced(peer)
        if announced is not None and announced.tcp != address:
            raise ProtocolError(f"{peer} names another TCP address than it announces")
        return address

    async def choose(self, *, peer: str, peer_host: str, peer_tcp: bytes,
                     peer_shared: shm.SharedExport | None, mem: RegisteredKV,
                     codec: str, proofs: list[bytes] | None = None,
                     transfer_id: str = "", peer_device: DeviceExport | None = None,
                     peer_offer: DeviceOffer | None = None) -> Choice:
        """The path into this destination (mapping the source's memory first if it may be
        ``shm`` or ``cuda_ipc``: blocking the first time, so on a thread; a pull's source
        names its device KV only in its answer, so its announced ``peer_offer`` picks
        ``cuda_ipc`` before; a push's ``peer_device`` is opened only if it is the one
        announced). CUDA refuses a process its own handles: agents in one process never
        take ``cuda_ipc`` between them. Release the choice unless a stream took its source
        (``Choice.source``)."""
        same = self.same_host(peer_host)
        mappable = same and not mem.layout.split  # a split pool's layer is two regions
        kv: Mapped | None = None
        maps: MapCache[Any] = self.maps
        ipc = mappable and codec == "none" and mem.device.type == "cuda" and \
            "cuda_ipc" in self.config.paths
        if ipc and peer_device is not None and self.ipc.announced(peer_device, peer_offer) \
                and self.ipc.may_open(peer, peer_offer):
            try:
                kv = await self.ipc.open(peer, peer_device, mem)
                maps = self.ipc.maps
            except KVStreamError as exc:
                log.info("%s's device KV is not opened here (%s)", peer, exc)
        if mappable and codec == "none" and peer_shared is not None and "shm" in self.config.paths \
                and mem.device.type == "cpu":
            context = shm.proof_context(peer, self.config.instance_id, transfer_id)
            try:
                kv = await anyio.to_thread.run_sync(
                    self.maps.acquire, peer_shared,
                    peer_shared.num_blocks * mem.layout.block_bytes, mem.layout.num_layers,
                    proofs, context)
            except KVStreamError as exc:
                # Not mappable here, or someone else's memory named by this peer: the
                # transfer takes another path (the sender's own bytes then move).
                log.info("%s's shared KV is not read here (%s)", peer, exc)
        try:
            tcp = self.check_tcp(peer, peer_tcp)
        except ProtocolError:
            tcp = b""
        can_map = kv is not None or \
            (ipc and peer_device is None and self.ipc.may_open(peer, peer_offer))
        path = choose(self.config.paths, same_host=same, device=mem.device.type, codec=codec,
                      can_map=can_map, peer_tcp=bool(tcp), own_tcp=bool(self.tcp_address))
        if path not in ("shm", "cuda_ipc") and kv is not None:
            maps.release(kv)
            kv = None
        return Choice(path, maps if kv is not None else self.ipc.maps if path == "cuda_ipc"
                      else self.maps, kv, tcp, self)

    def refusal(self, path: str, *, peer: str, peer_tcp: bytes, codec: str,
                sent_device: bool = True) -> str | None:
        """Why this source will not send to ``peer`` on ``path`` (None: it will)."""
        if path not in self.config.paths:
            return f"path {path!r} is not one this instance offers ({', '.join(self.config.paths)})"
        # A peer on another host cannot open our segments: no same-host check needed here.
        if path == "shm" and (self.shared is None or codec != "none"):
            return "shm needs codec 'none' and KV in shared memory here"
        if path == "cuda_ipc" and (not sent_device or self.device_for(peer, path, codec) is None):
            return ("cuda_ipc needs codec 'none', device KV exported here and a peer on this "
                    "host offering CUDA IPC from another process")
        if path == "tcp":
            if not self.tcp_address:
                return "tcp is offered for host KV only"
            try:
                if not self.check_tcp(peer, peer_tcp):
                    return "tcp needs a TCP data address on both ends"
            except ProtocolError as exc:
                return str(exc)
        return None

    def transport(self, path: str, base: Transport) -> Transport:
        if path == "tcp":
            assert self.tcp is not None  # checked by choose / refusal
            return self.tcp
        return base

    def record(self, transfer: Transfer, path: str, peer_host: str) -> None:
        transfer.path = label(path, same_host=self.same_host(peer_host))

    def forget(self, peer: str, shared: shm.SharedExport | None) -> None:
        """A peer is gone or moved its KV: its mappings go once no transfer reads them."""
        if shared is not None:
            self.maps.drop(shared.pid)
        self.ipc.forget(peer)

    def prune(self, live_pids: set[int], live_peers: set[str]) -> None:
        """Unmap (once unused) the KV of processes no live peer announces: a silent peer's
        memory would otherwise stay alive through our mapping."""
        self.maps.drop_except(live_pids)
        self.ipc.prune(live_peers)

    def close(self) -> None:
        self.maps.drop()
        self.ipc.close()
