"""Small rules every part of the engine applies alike: block lists, skips, reject codes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import msgspec

from kvstream._exceptions import (
    ConfigError,
    ForbiddenError,
    IncompatiblePeerError,
    InvalidBlockError,
    KVStreamError,
    LayoutError,
    ProtocolError,
)
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.layout import FP8_DTYPES, KVLayout
from kvstream.quant.scheme import CODEC_DTYPES, CODECS, wire_fingerprint, wire_layer_bytes
from kvstream.transfer.plan import Reshape, TpInfo, part_refusal, reshape_for

if TYPE_CHECKING:
    from kvstream.control.registry import Registry
    from kvstream.dataplane.transport import Transport
    from kvstream.memory import RegisteredKV
    from kvstream.transfer.state import Transfer

__all__ = [
    "PULL_MODES",
    "PUSH_MODES",
    "REJECT_ERRORS",
    "check_hashes",
    "check_mode",
    "check_skip",
    "claimed_sender",
    "layout_mismatch",
    "needs_reshape",
    "part_mismatch",
    "peer_refusal",
    "reshape_between",
    "reshape_refusal",
    "shrink",
    "without",
]

PUSH_MODES: Final = ("pipelined", "eager")
PULL_MODES: Final = ("eager", "lazy")

# What a peer's Reject code means to the engine (push and pull alike).
REJECT_ERRORS: Final[dict[str, type[KVStreamError]]] = {
    "incompatible": IncompatiblePeerError,
    "invalid_blocks": InvalidBlockError,
    "malformed": ProtocolError,
    "forbidden": ForbiddenError,
    "unauthenticated": ForbiddenError,
}


def peer_refusal(peer: str, address: bytes, registry: Registry, transport: Transport,
                 what: str) -> tuple[m.RejectCode, str] | None:
    """Why a manifest or pull naming ``peer`` at ``address`` is refused, if it is: a bad
    id or a malformed worker address (before UCX sees it), or not the address ``peer``
    announces."""
    try:
        Subjects.check_instance_id(peer)
    except ConfigError as exc:
        return "malformed", str(exc)
    try:
        transport.check_address(address)
    except ProtocolError as exc:
        return "malformed", f"the {what}'s worker address: {exc}"
    if not registry.address_ok(peer, address):
        return "forbidden", f"the {what} names another worker address than {peer} announces"
    return None


def claimed_sender(msg: object) -> str | None:
    """The instance a control request says it comes from (checked against its signer)."""
    match msg:
        case m.Manifest():
            return msg.src
        case m.Pull():
            return msg.dst
        case m.Renew() | m.Abort():
            return msg.by
        case m.Announce() | m.Leave():
            return msg.instance_id
    return None


def check_mode(mode: str, modes: Sequence[str]) -> None:
    if mode not in modes:
        raise ConfigError(f"mode must be one of {tuple(modes)}, got {mode!r}")


def without(ids: Sequence[int], skip: Sequence[int]) -> list[int]:
    drop = set(skip)
    return [b for i, b in enumerate(ids) if i not in drop]


def check_skip(skip: Sequence[int], nblocks: int) -> None:
    """A peer's skip list must name distinct positions of this transfer's blocks."""
    if len(set(skip)) != len(skip) or any(not 0 <= i < nblocks for i in skip):
        raise ProtocolError(f"skip list {list(skip)[:8]} does not index {nblocks} blocks")


def shrink(t: Transfer, mem: RegisteredKV, total: int, kept: int) -> None:
    """Account a transfer for only the blocks that move (in wire bytes of its codec); the
    rest counts as skipped (in engine bytes)."""
    t.layer_bytes = t.reshape.layer_bytes(mem.layout) if t.reshape is not None else \
        wire_layer_bytes(mem.layout, t.codec, kept)
    t.bytes_skipped = mem.planes * mem.plane_bytes(total - kept) * t.num_layers


def check_hashes(block_hashes: Sequence[int] | None, nblocks: int) -> list[int]:
    hashes = list(block_hashes or [])  # the first blocks' (a partial last block has none)
    if len(hashes) > nblocks:
        raise InvalidBlockError(f"{len(hashes)} block hashes for {nblocks} blocks")
    return hashes


def layout_mismatch(mem: RegisteredKV, fingerprint: str, num_layers: int, codec: str = "none",
                    cache_scales: Sequence[float] | None = None) -> str | None:
    """Why a peer's KV, sent with ``codec``, cannot land in ``mem`` (None: it can).
    ``cache_scales``: the peer's FP8 cache scales, checked when given."""
    if codec not in CODECS:
        return f"unknown codec {codec!r} (this side knows {', '.join(CODECS)})"
    if codec != "none" and mem.layout.dtype not in CODEC_DTYPES:
        return f"codec {codec} cannot land in this {mem.layout.dtype} cache"
    mine = wire_fingerprint(mem.layout, codec)
    if fingerprint != mine or num_layers != mem.layout.num_layers:
        return (f"{'layout' if codec == 'none' else codec} fingerprint {fingerprint} != "
                f"{mine} ({mem.layout.describe()})")
    if codec == "none" and cache_scales is not None and list(cache_scales) != mem.cache_scales:
        return (f"FP8 cache scales differ: the peer's {list(cache_scales)[:4]}..., "
                f"this cache's {mem.cache_scales[:4]}...; the bytes would mean other values")
    return None


def needs_reshape(src: KVLayout, src_tp: TpInfo, dst: KVLayout, dst_tp: TpInfo) -> bool:
    """Do two instances' blocks differ in bytes or in which heads they hold (issue 18)?"""
    if src.fingerprint != dst.fingerprint:
        return True
    try:
        return src_tp.shard(src).heads != dst_tp.shard(dst).heads
    except LayoutError:
        return True  # a share that does not fit its layout: reshape_between says why


def reshape_between(src: KVLayout, src_tp: TpInfo, dst: KVLayout, dst_tp: TpInfo,
                    tokens: int, single: bool = False) -> Reshape:
    """The plan of a one-source transfer; ``IncompatiblePeerError`` naming both sides if
    there is none. ``single``: one message per layer (both ends' KV in host memory)."""
    try:
        r = reshape_for(src_tp.shard(src), dst_tp.shard(dst), tokens)
    except LayoutError as exc:
        raise IncompatiblePeerError(str(exc)) from None
    return msgspec.structs.replace(r, single=single)


def part_mismatch(r: Reshape, src: KVLayout, src_tp: TpInfo, dst: KVLayout,
                  dst_tp: TpInfo) -> str | None:
    """Why ``r`` is not a safe part of a plan between two instances (None: it is): what a
    source checks of a pull asking for some of its heads."""
    try:
        return part_refusal(r, src_tp.shard(src), dst_tp.shard(dst))
    except LayoutError as exc:
        return str(exc)


def reshape_refusal(msg: m.Manifest, mem: RegisteredKV, tp: TpInfo) -> str | None:
    """Why a destination refuses a manifest's reshape (None: it derives the same plan)."""
    r = msg.reshape
    if r is None or msg.src_layout is None:
        return "a reshaped transfer without the source's layout"
    if msg.codec != "none":
        return f"codec {msg.codec} between unequal layouts is not supported"
    if msg.num_layers != mem.layout.num_layers:
        return f"{msg.num_layers} layers against {mem.layout.num_layers}"
    try:
        mine = reshape_between(msg.src_layout, msg.src_tp or TpInfo(), mem.layout, tp, r.tokens)
    except IncompatiblePeerError as exc:
        return str(exc)
    if msgspec.structs.replace(r, single=False) != mine:
        return f"the source's plan {r} is not this side's {mine}"
    if r.single and mem.device.type != "cpu":
        return "one-message framing needs host KV here"
    if len(msg.src_blocks) != msg.src_layout.blocks_for_tokens(r.tokens):
        return (f"{len(msg.src_blocks)} source blocks for {r.tokens} tokens of "
                f"{msg.src_layout.block_size}")
    if mem.layout.blocks_for_tokens(r.tokens) > mem.num_blocks:
        return f"{r.tokens} tokens do not fit in {mem.num_blocks} blocks"
    if mem.layout.dtype in FP8_DTYPES and list(msg.cache_scales) != mem.cache_scales:
        return "FP8 cache scales differ: the bytes would mean other values"
    return None
