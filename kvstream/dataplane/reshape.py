"""A transfer between unequal layouts through the streams' codec seam (issue 18).

The streams call ``encode`` / ``decode`` of a codec in place of gather / scatter and stage
both ends (``single_message_for`` with a codec); ``ReshapeCodec`` is that codec for a
``Reshape``: the source packs its blocks of a layer into the canonical wire
``[kv, tokens, heads, head_dim]`` (``transfer.plan.pack``), the destination unpacks it
into its own blocks, arrangement, block size and dtype (``unpack``). Equal layouts never
come here. ``transfer_codec`` picks what a transfer's streams use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstream._exceptions import LayoutError
from kvstream.dataplane.stream import single_message_for
from kvstream.quant.codec import make_codec
from kvstream.quant.scheme import wire_layer_bytes
from kvstream.transfer.plan import Reshape, pack, unpack

if TYPE_CHECKING:
    import torch

    from kvstream.memory import BlockMap, RegisteredKV
    from kvstream.transfer.state import Transfer

__all__ = ["ReshapeCodec", "layer_bytes_of", "single_for", "transfer_codec"]


class ReshapeCodec:
    name = "reshape"

    def __init__(self, mem: RegisteredKV, reshape: Reshape) -> None:
        self.mem, self.reshape = mem, reshape
        self._bytes = reshape.layer_bytes(mem.layout)

    def layer_bytes(self, nblocks: int = 0) -> int:
        return self._bytes

    def _wire(self, buf: torch.Tensor) -> torch.Tensor:
        import torch

        r, lay = self.reshape, self.mem.layout
        if buf.numel() < self._bytes:
            raise LayoutError(f"a {buf.numel()}-byte buffer cannot hold a {self._bytes}-byte "
                              "reshaped layer")
        return buf[:self._bytes].view(getattr(torch, r.dtype)).view(
            lay.kv_factor, r.tokens, r.heads, lay.head_dim)

    def encode(self, layer: int, blocks: BlockMap, buf: torch.Tensor) -> None:
        r = self.reshape
        heads = range(r.src_head, r.src_head + r.heads)
        pack(self.mem.layer_tensors(layer), self.mem.layout, blocks.ids, r.tokens, heads,
             out=self._wire(buf))

    def decode(self, layer: int, blocks: BlockMap, buf: torch.Tensor) -> None:
        unpack(self._wire(buf), self.mem.layer_tensors(layer), self.mem.layout, blocks.ids,
               self.reshape.dst_head)


def transfer_codec(mem: RegisteredKV, t: Transfer) -> Any:
    """What the streams encode and decode with: the reshape, the wire codec, or None."""
    if t.reshape is not None:
        return ReshapeCodec(mem, t.reshape)
    return make_codec(mem, t.codec)


def single_for(mem: RegisteredKV, t: Transfer, src_contiguous: bool, dst_contiguous: bool,
               path: str, peer_on_cpu: bool = True) -> bool:
    """The framing both ends derive: a reshape's is in the plan (``Reshape.single``, made
    from both ends' devices)."""
    if t.reshape is not None:
        return t.reshape.single and mem.device.type == "cpu"
    return single_message_for(mem, src_contiguous, dst_contiguous, t.codec, path, peer_on_cpu)


def layer_bytes_of(mem: RegisteredKV, t: Transfer, nblocks: int) -> int:
    if t.reshape is not None:
        return t.reshape.layer_bytes(mem.layout)
    return wire_layer_bytes(mem.layout, t.codec, nblocks)
