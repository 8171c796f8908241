"""Fuzzing both wire schemas: control messages (NATS) and the data plane's layer header
and credit (UCX).

What must hold for bytes from anyone: decoding returns a valid message or raises
``MessageDecodeError`` (control) / ``ProtocolError`` (data plane), never anything else;
valid messages round-trip; every bound ``msgspec.Meta`` states in ``messages.py`` is
enforced at decoding. Strategies and bounds are derived from the Struct types
(``msgspec.inspect``), so a field added to a message is fuzzed without touching this file;
the factories below are the one place that knows how a message is built.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi

from kvstream._exceptions import MessageDecodeError, ProtocolError
from kvstream.control import messages as m
from kvstream.dataplane import wire
from kvstream.layout import ARRANGEMENTS, DTYPE_BYTES, KVLayout

# -- factories: how a valid message is built (update here when the schema changes) -------

MESSAGE_TYPES: tuple[type[m.ControlMessage], ...] = typing.get_args(m.ControlUnion)
INT64, UINT64 = (-(1 << 63), (1 << 63) - 1), (0, (1 << 64) - 1)


def layout(**kw: Any) -> KVLayout:
    return KVLayout(**{"num_layers": 4, "num_kv_heads": 2, "head_dim": 32, "block_size": 8, **kw})


def message(cls: type[m.ControlMessage], **fields: Any) -> m.ControlMessage:
    """A valid ``cls``: every required field at its smallest valid value, then ``fields``."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    base = {f.name: minimal(f.type) for f in info.fields if f.required}
    return cls(**{**base, **fields})


def header(**kw: Any) -> wire.LayerHeader:
    info = mi.type_info(wire.LayerHeader)
    assert isinstance(info, mi.StructType)
    base = {f.name: minimal(f.type) for f in info.fields if f.required}
    return wire.LayerHeader(**{**base, **kw})


# Nested structs that validate themselves (``__post_init__``) rather than through Meta.
STRUCTS: dict[type, st.SearchStrategy[Any]] = {
    KVLayout: st.builds(
        layout, num_layers=st.integers(1, 1 << 40), num_kv_heads=st.integers(1, 256),
        head_dim=st.integers(1, 1 << 12), block_size=st.integers(1, 1 << 12),
        dtype=st.sampled_from(sorted(DTYPE_BYTES)),
        arrangement=st.sampled_from(sorted(set(ARRANGEMENTS) - {"mla"}))),
}
STRUCT_MINIMAL: dict[type, Any] = {KVLayout: layout()}
STRUCT_VIOLATIONS: dict[type, list[dict[str, Any]]] = {
    KVLayout: [{"num_layers": 0}, {"num_kv_heads": -3}, {"head_dim": 1.5},
               {"block_size": "8"}, {"dtype": "int4"}, {"dtype": "x" * (1 << 20)},
               {"arrangement": "nope"}, {"arrangement": "mla", "num_kv_heads": 2}],
}


# -- the type walker: msgspec.inspect types -> values, strategies, bound violations -------

def _int_range(t: mi.IntType, default: tuple[int, int] = UINT64) -> tuple[int, int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else default[0])
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else default[1])
    return lo, hi


def _float_range(t: mi.FloatType) -> tuple[float, float]:
    lo = t.ge if t.ge is not None else t.gt if t.gt is not None else -1e300
    hi = t.le if t.le is not None else t.lt if t.lt is not None else 1e300
    return float(lo), float(hi)


def minimal(t: mi.Type) -> Any:
    match t:
        case mi.IntType():
            lo, hi = _int_range(t, INT64)
            return min(max(lo, 0), hi)
        case mi.FloatType():
            lo, hi = _float_range(t)
            return min(max(lo, 1.0), hi)
        case mi.StrType():
            return "x" * (t.min_length or 1)
        case mi.BytesType():
            return b"x" * (t.min_length or 1)
        case mi.BoolType():
            return False
        case mi.NoneType():
            return None
        case mi.LiteralType():
            return t.values[0]
        case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
            return [minimal(t.item_type)] * (t.min_length or 0)
        case mi.TupleType():
            return [minimal(u) for u in t.item_types]
        case mi.DictType():
            return {} if not t.min_length else {
                f"k{i}" if isinstance(t.key_type, mi.StrType) else i: minimal(t.value_type)
                for i in range(t.min_length)}
        case mi.UnionType():
            return minimal(next((u for u in t.types if isinstance(u, mi.NoneType)), t.types[0]))
        case mi.StructType() if t.cls in STRUCT_MINIMAL:
            return STRUCT_MINIMAL[t.cls]
        case mi.StructType():  # validated by its fields' Meta alone
            return t.cls(**{f.name: minimal(f.type) for f in t.fields if f.required})
    raise NotImplementedError(f"no minimal value for {t}")


def valid(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values decoding must accept (sizes kept small: big sizes are the bounds tests')."""
    match t:
        case mi.IntType():
            lo, hi = _int_range(t)
            return st.integers(max(lo, INT64[0]), min(hi, UINT64[1]))
        case mi.FloatType():
            lo, hi = _float_range(t)
            return st.floats(lo, hi, exclude_min=t.gt is not None, exclude_max=t.lt is not None,
                             allow_nan=False, allow_infinity=False)
        case mi.StrType():
            if t.pattern:
                return st.from_regex(t.pattern, fullmatch=True)
            return st.text(min_size=t.min_length or 0, max_size=min(t.max_length or 40, 40))
        case mi.BytesType():
            return st.binary(min_size=t.min_length or 0, max_size=min(t.max_length or 64, 64))
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.ListType() | mi.VarTupleType():
            return st.lists(valid(t.item_type), min_size=t.min_length or 0,
                            max_size=min(t.max_length or 6, 6))
        case mi.SetType() | mi.FrozenSetType():
            return st.frozensets(valid(t.item_type), min_size=t.min_length or 0,
                                 max_size=min(t.max_length or 6, 6)).map(
                frozenset if isinstance(t, mi.FrozenSetType) else set)
        case mi.TupleType():
            return st.tuples(*[valid(u) for u in t.item_types])
        case mi.DictType():
            return st.dictionaries(valid(t.key_type), valid(t.value_type),
                                   min_size=t.min_length or 0, max_size=min(t.max_length or 4, 4))
        case mi.UnionType():
            return st.one_of([valid(u) for u in t.types])
        case mi.StructType() if t.cls in STRUCTS:
            return STRUCTS[t.cls]
        case mi.StructType():  # validated by its fields' Meta alone
            return st.builds(t.cls, **{f.name: valid(f.type) for f in t.fields})
    raise NotImplementedError(f"no strategy for {t}")


def instances(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = {f.name: valid(f.type) for f in info.fields if f.name != "v"}
    if any(f.name == "v" for f in info.fields):
        fields["v"] = st.integers(m.MIN_PROTOCOL_VERSION, m.PROTOCOL_VERSION)
    return st.builds(cls, **fields)


def violations(t: mi.Type) -> Iterator[tuple[str, Any]]:
    """(what, a builtin value) that decoding a field of type ``t`` must refuse."""
    match t:
        case mi.IntType():
            for bound, bad in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
                if (v := getattr(t, bound)) is not None:
                    yield f"{bound}={v}", v + bad
            yield "a float", 1.5
            yield "a string", "1"
        case mi.FloatType():
            lo, hi = _float_range(t)
            if t.ge is not None or t.gt is not None:
                yield "below", (lo - 1.0 if t.ge is not None else lo)
                yield "-inf", -math.inf
            if t.le is not None or t.lt is not None:
                yield "above", (hi * 2 + 1.0 if t.le is not None else hi)
                yield "inf", math.inf
            if any(b is not None for b in (t.ge, t.gt, t.le, t.lt)):
                yield "nan", math.nan
            yield "a string", "1.0"
        case mi.StrType():
            if t.max_length is not None:
                yield f"max_length={t.max_length}", "é" * (t.max_length + 1)
            yield "bytes", b"x"
            yield "an int", 7
        case mi.BytesType():
            if t.max_length is not None:
                yield f"max_length={t.max_length}", b"\xff" * (t.max_length + 1)
            yield "a list", [1, 2]
        case mi.LiteralType():
            yield "not one of the literals", "no-such-" + "x" * 100
            yield "an int", 0
        case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
            if t.max_length is not None:
                many = [minimal(t.item_type)] * (t.max_length + 1)
                if not isinstance(t, mi.ListType | mi.VarTupleType):
                    many = [_distinct(t.item_type, i) for i in range(t.max_length + 1)]
                yield f"max_length={t.max_length}", many
            for what, bad in violations(t.item_type):
                yield f"an item {what}", [bad]
            yield "a map", {"a": 1}
        case mi.DictType():
            if t.max_length is not None:
                yield f"max_length={t.max_length}", {
                    _distinct(t.key_type, i): minimal(t.value_type)
                    for i in range(t.max_length + 1)}
            for what, bad in violations(t.key_type):
                if isinstance(bad, str | int | float) and not (isinstance(bad, float)
                                                              and math.isnan(bad)):
                    yield f"a key {what}", {bad: minimal(t.value_type)}
            for what, bad in violations(t.value_type):
                yield f"a value {what}", {_distinct(t.key_type, 0): bad}
            yield "a list", [1, 2]
        case mi.UnionType():
            for u in t.types:
                if isinstance(u, mi.StructType) and u.cls in STRUCT_VIOLATIONS:
                    base = raw(STRUCT_MINIMAL[u.cls])
                    for bad in STRUCT_VIOLATIONS[u.cls]:
                        yield f"{u.cls.__name__} {sorted(bad)}", {**base, **bad}
            yield "an int", 3


def at_limits(t: mi.Type) -> Iterator[tuple[str, Any]]:
    """(what, value) at the edge of a bound: decoding must accept it."""
    match t:
        case mi.IntType():
            lo, hi = _int_range(t)
            yield "lowest", lo if lo >= INT64[0] else INT64[0]
            yield "highest", hi if hi <= UINT64[1] else UINT64[1]
        case mi.FloatType():
            lo, hi = _float_range(t)
            if t.ge is not None:
                yield "ge", lo
            if t.le is not None:
                yield "le", hi
        case mi.StrType() if t.max_length is not None:
            # Multi-byte characters, unless a pattern (a note's topic) allows only ASCII.
            yield "max_length", ("a" if t.pattern else "é") * t.max_length
        case mi.BytesType() if t.max_length is not None:
            yield "max_length", b"\x00" * t.max_length
        case mi.ListType() if t.max_length is not None:
            yield "max_length", [minimal(t.item_type)] * t.max_length
        case mi.DictType() if t.max_length is not None:
            yield "max_length", {_distinct(t.key_type, i): minimal(t.value_type)
                                 for i in range(t.max_length)}


def _distinct(t: mi.Type, i: int) -> Any:
    """The ``i``-th of many distinct valid values of ``t`` (keys, set items)."""
    if isinstance(t, mi.StrType):
        return f"k{i}"
    if isinstance(t, mi.IntType):
        return _int_range(t, INT64)[0] + i if _int_range(t, INT64)[0] > INT64[0] else i
    raise NotImplementedError(f"no distinct values for {t}")


def _fields(cls: type) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


# -- what every decode must do ----------------------------------------------------------

def decode_or_refuse(data: bytes) -> m.ControlMessage | None:
    """Decode; a refusal must be ``MessageDecodeError`` (anything else fails the test).
    What decodes must be a known message that re-encodes to something that decodes alike."""
    try:
        msg = m.decode(data)
    except MessageDecodeError:
        return None
    assert isinstance(msg, MESSAGE_TYPES), type(msg)
    again = m.encode(msg)
    assert m.encode(m.decode(again)) == again
    return msg


def decode_header_or_refuse(buf: Any) -> wire.LayerHeader | None:
    try:
        h = wire.decode_header(memoryview(buf))
    except ProtocolError:
        return None
    assert isinstance(h, wire.LayerHeader)
    return h


def raw(msg: msgspec.Struct) -> dict[str, Any]:
    """The message as MessagePack builtins (bytes stay bytes), ready to be mangled."""
    return typing.cast(dict[str, Any], msgspec.to_builtins(msg, builtin_types=(bytes,)))


FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
any_message = st.one_of([instances(cls) for cls in MESSAGE_TYPES])
# Any MessagePack value, the odd ones weighted in: NaN/inf, ints at the 64-bit edges,
# negative ints, giant strings, huge lists, nested maps.
odd_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(*INT64), st.integers(*UINT64),
    st.sampled_from([-1, 0, 1 << 31, 1 << 32, 1 << 48, (1 << 63) - 1, (1 << 64) - 1, -(1 << 63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308]),
    st.text(max_size=16), st.binary(max_size=16),
    st.sampled_from(["x" * (1 << 16), "é" * 9000, "\x00", "kv.manifest"]),
    st.sampled_from([b"\xff" * ((64 << 10) + 1), b""]),
    # (lists beyond MAX_BLOCKS are the bounds tests'; here long enough to be walked)
    st.sampled_from([[0] * 5000, list(range(-3, 3)), [math.nan] * 10, [[]] * 100]),
)
any_value = st.recursive(odd_scalars, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


# -- control messages ----------------------------------------------------------------------

def test_every_message_type_has_a_factory_and_a_tag():
    tags = [cls.__struct_config__.tag for cls in MESSAGE_TYPES]
    assert len(set(tags)) == len(tags) == len(MESSAGE_TYPES)
    for cls in MESSAGE_TYPES:
        msg = message(cls)
        assert m.decode(m.encode(msg)) == msg


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_every_variable_size_field_is_bounded(cls):
    """A peer controls every byte: nothing of unbounded size may decode (a bound added
    to a field later keeps this passing; a new unbounded field fails it)."""
    def unbounded(t: mi.Type, path: str) -> Iterator[str]:
        match t:
            case mi.StrType() | mi.BytesType() if t.max_length is None:
                yield path
            case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
                if t.max_length is None:
                    yield path
                yield from unbounded(t.item_type, path + "[]")
            case mi.DictType():
                if t.max_length is None:
                    yield path
                yield from unbounded(t.key_type, path + "{key}")
                yield from unbounded(t.value_type, path + "{}")
            case mi.UnionType():
                for u in t.types:
                    yield from unbounded(u, path)

    found = [p for f in _fields(cls) for p in unbounded(f.type, f"{cls.__name__}.{f.name}")]
    assert not found, f"unbounded on the wire: {found}"


@FUZZ
@given(any_message)
def test_valid_messages_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_decode_or_are_refused(data):
    decode_or_refuse(data)


@FUZZ
@given(st.sampled_from(MESSAGE_TYPES).flatmap(instances), st.binary(max_size=64))
def test_msgpack_map_prefix_then_garbage(msg, junk):
    # A real message's first bytes, then noise: the map header promises more than is there.
    data = m.encode(msg)
    decode_or_refuse(data[: len(data) // 2] + junk)


@FUZZ
@given(any_message, st.data())
def test_truncations_are_refused(msg, data):
    enc = m.encode(msg)
    cut = data.draw(st.integers(0, len(enc) - 1))
    with pytest.raises(MessageDecodeError):
        m.decode(enc[:cut])


@FUZZ
@given(any_message, st.lists(st.tuples(st.integers(0), st.integers(1, 255)), min_size=1,
                             max_size=8))
def test_byte_flips_decode_or_are_refused(msg, flips):
    enc = bytearray(m.encode(msg))
    for pos, mask in flips:
        enc[pos % len(enc)] ^= mask
    decode_or_refuse(bytes(enc))


@FUZZ
@given(any_message, st.data())
def test_wrong_shapes_decode_or_are_refused(msg, data):
    """Valid MessagePack of the wrong shape: a field replaced by anything, a required
    field dropped, unknown fields, the tag or version changed."""
    doc = raw(msg)
    keys = sorted(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.sampled_from(["replace", "drop", "add", "op", "v"]))
        if what == "replace":
            doc[data.draw(st.sampled_from(keys))] = data.draw(any_value)
        elif what == "drop":
            doc.pop(data.draw(st.sampled_from(keys)), None)
        elif what == "add":
            doc[data.draw(st.text(max_size=12))] = data.draw(any_value)
        elif what == "op":
            doc["op"] = data.draw(st.sampled_from(
                [c.__struct_config__.tag for c in MESSAGE_TYPES]) | any_value)
        else:
            doc["v"] = data.draw(st.integers(*INT64) | any_value)
    try:
        enc = msgspec.msgpack.encode(doc)
    except (OverflowError, TypeError):
        return  # not representable in MessagePack (e.g. a dict key that is not a str)
    decode_or_refuse(enc)


@FUZZ
@given(st.dictionaries(st.text(max_size=16), any_value, max_size=8),
       st.sampled_from([c.__struct_config__.tag for c in MESSAGE_TYPES]))
def test_random_maps_with_a_real_tag(doc, tag):
    decode_or_refuse(msgspec.msgpack.encode({**doc, "op": tag}))


def _bound_cases(check: typing.Callable[[mi.Type], Iterator[tuple[str, Any]]]
                 ) -> list[Any]:
    cases = []
    for cls in MESSAGE_TYPES:
        for f in _fields(cls):
            if f.name == "v":
                continue  # the version's bound is decode()'s own (test_protocol_version_bound)
            for what, value in check(f.type):
                cases.append(pytest.param(cls, f.encode_name, value,
                                          id=f"{cls.__name__}.{f.name}-{what}"))
    return cases


@pytest.mark.parametrize(("cls", "field", "bad"), _bound_cases(violations))
def test_bounds_are_enforced(cls, field, bad):
    doc = {**raw(message(cls)), field: bad}
    with pytest.raises(MessageDecodeError):
        m.decode(msgspec.msgpack.encode(doc))


@pytest.mark.parametrize(("cls", "field", "edge"), _bound_cases(at_limits))
def test_values_at_the_bounds_are_accepted(cls, field, edge):
    doc = {**raw(message(cls)), field: edge}
    msg = m.decode(msgspec.msgpack.encode(doc))
    assert raw(msg)[field] == msgspec.to_builtins(edge, builtin_types=(bytes,))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x80", b"\x90", b"\xdf\xff\xff\xff\xff",  # a map claiming 4e9 entries
    msgspec.msgpack.encode({"op": "kv.renew", "by": "d"})[:-1] + b"\xdd\xff\xff\xff\xff",
    b"\x81\xa2op" + b"\x91" * 200_000 + b"\xc0",  # deep nesting where a str belongs
    b"\x83\xa2op\xa8kv.leave\xabinstance_id\xa1a\xa4junk" + b"\x91" * 1_000_000 + b"\xc0",
    msgspec.msgpack.encode({"op": "kv.leave", "v": -(1 << 63), "instance_id": "a"}),
    msgspec.msgpack.encode({"op": "kv.leave", "v": 1.5, "instance_id": "a"}),
    msgspec.msgpack.encode({"op": "kv.leave", "v": m.PROTOCOL_VERSION, "instance_id": None}),
    msgspec.msgpack.encode([{"op": "kv.leave", "instance_id": "a"}]),
], ids=lambda d: d[:12].hex())
def test_pathological_inputs_are_refused(data):
    assert decode_or_refuse(data) is None


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_protocol_version_bound(cls):
    doc = raw(message(cls))
    for v in (m.MIN_PROTOCOL_VERSION, m.PROTOCOL_VERSION):
        assert m.decode(msgspec.msgpack.encode({**doc, "v": v})).v == v
    for v in (m.MIN_PROTOCOL_VERSION - 1, -1, -(1 << 63), "2", 2.0, None):
        with pytest.raises(MessageDecodeError):
            m.decode(msgspec.msgpack.encode({**doc, "v": v}))


def test_unknown_extension_types_in_unknown_fields_are_skipped():
    doc = {**raw(message(m.Leave, instance_id="a")), "x": msgspec.msgpack.Ext(1, b"\0" * 9)}
    assert decode_or_refuse(msgspec.msgpack.encode(doc)) == message(m.Leave, instance_id="a")


# -- the data plane: layer header and credit ----------------------------------------------

def _header_buf(h: wire.LayerHeader) -> np.ndarray:
    buf = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
    wire.encode_header(h, buf.data)
    return buf


headers = st.builds(wire.LayerHeader, **{
    f.name: (st.integers(*INT64) if isinstance(f.type, mi.IntType) else valid(f.type))
    for f in _fields(wire.LayerHeader)})


@FUZZ
@given(headers)
def test_header_round_trip(h):
    buf = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
    try:
        wire.encode_header(h, buf.data)
    except ProtocolError:
        return  # longer than the header capacity: refused at the sender
    assert wire.decode_header(buf.data) == h


@FUZZ
@given(st.binary(max_size=wire.HEADER_CAPACITY + 64))
def test_header_arbitrary_bytes(data):
    decode_header_or_refuse(np.frombuffer(data, dtype=np.uint8) if data else b"")


@FUZZ
@given(headers, st.data())
def test_header_truncations_and_flips(h, data):
    try:
        buf = _header_buf(h)
    except ProtocolError:
        return
    used = 2 + int.from_bytes(bytes(buf[:2]), "little")
    cut = data.draw(st.integers(0, used))
    decode_header_or_refuse(buf[:cut].copy())
    flipped = buf.copy()
    for pos, mask in data.draw(st.lists(st.tuples(st.integers(0, used - 1), st.integers(1, 255)),
                                        min_size=1, max_size=6)):
        flipped[pos] ^= mask
    decode_header_or_refuse(flipped)


@FUZZ
@given(any_value | st.lists(any_value, min_size=4, max_size=8))
def test_header_wrong_shapes(doc):
    try:
        body = msgspec.msgpack.encode(doc)
    except (OverflowError, TypeError):
        return
    buf = np.zeros(max(wire.HEADER_CAPACITY, 2 + len(body)), dtype=np.uint8)
    buf[:2] = np.frombuffer(min(len(body), 0xFFFF).to_bytes(2, "little"), dtype=np.uint8)
    buf[2:2 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    decode_header_or_refuse(buf)


@pytest.mark.parametrize("body", [
    b"\x96" + b"\x91" * 400 + b"\xc0",  # nested where an int belongs
    msgspec.msgpack.encode([1, 2, 3, 4, "none", ""])[:-1] + b"\x91" * 480 + b"\xc0",
    msgspec.msgpack.encode([1, 2, 3]),  # too few fields
    msgspec.msgpack.encode([1.5, 2, 3, 4]), msgspec.msgpack.encode([1, 2, 3, 4, 5, 6]),
    msgspec.msgpack.encode({"xfer_tag": 1, "layer": 1, "nbytes": 1, "parts": 1}),
    msgspec.msgpack.encode([(1 << 64) - 1, -1, -(1 << 63), math.nan]),
], ids=lambda b: b[:10].hex())
def test_header_pathological_bodies(body):
    buf = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
    buf[:2] = np.frombuffer(len(body).to_bytes(2, "little"), dtype=np.uint8)
    buf[2:2 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    decode_header_or_refuse(buf)


@pytest.mark.parametrize("size", [0, 1])
def test_header_buffers_too_short_for_the_length_prefix(size):
    with pytest.raises(ProtocolError):
        wire.decode_header(memoryview(b"\x05" * size))


@FUZZ
@given(st.integers(0, INT64[1]))
def test_credit_round_trip(n):
    assert wire.decode_credit(wire.encode_credit(n)) == n


@FUZZ
@given(st.binary(max_size=24))
def test_credit_arbitrary_bytes(data):
    try:
        n = wire.decode_credit(np.frombuffer(data, dtype=np.uint8).data if data else b"")
    except ProtocolError:
        assert len(data) < 8
        return
    assert isinstance(n, int) and INT64[0] <= n <= INT64[1]
