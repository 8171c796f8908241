"""``expect`` names its one source: ``src`` is required (keyword-only, no default) on every
surface that reserves for a push, down to the sidecar's local message. A default would
bring back "whoever pushes first lands", which on a shared bus lets any agent fill the
reservation with its own KV."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

import kvstream
import kvstream.client
from kvstream._exceptions import MessageDecodeError
from kvstream.blocking import BlockingClient
from kvstream.client import _LocalClient, _SidecarClient
from kvstream.client_api import TransferClient
from kvstream.engine.admission import Admission
from kvstream.sidecar import protocol as lp

EXPECTS: dict[str, Callable[..., Any]] = {
    "Agent": kvstream.Agent.expect,
    "TransferClient": TransferClient.expect,
    "Client.local": _LocalClient.expect,
    "Client.connect": _SidecarClient.expect,
    "BlockingClient": BlockingClient.expect,
    "Admission": Admission.expect,
}
# kvstream.client.Client is a factory of the two above; a RemoteClient, where there is one,
# is held to the same rule.
if hasattr(kvstream.client, "RemoteClient"):
    EXPECTS["RemoteClient"] = kvstream.client.RemoteClient.expect


@pytest.mark.parametrize("name", list(EXPECTS))
def test_src_is_a_required_keyword_only_parameter(name: str) -> None:
    params = inspect.signature(EXPECTS[name]).parameters
    assert "src" in params, name
    src = params["src"]
    assert src.kind is inspect.Parameter.KEYWORD_ONLY, (name, src.kind)
    assert src.default is inspect.Parameter.empty, (name, src.default)


def test_an_agent_expect_without_src_is_a_type_error() -> None:
    """Not even reached: the call itself fails (no agent needs to run for it)."""
    with pytest.raises(TypeError, match="src"):
        kvstream.Agent.expect(object(), "r", [1])  # type: ignore[arg-type,call-arg]


def _expect_without_src() -> bytes:
    whole = msgspec.to_builtins(msgspec.msgpack.decode(lp.encode(
        lp.Expect(id=3, request_id="r", blocks=[1, 2], src="prefill-0", have=[7]))))
    assert whole["op"] == "expect" and whole["src"] == "prefill-0"
    del whole["src"]
    return msgspec.msgpack.encode(whole)


def test_the_sidecar_expect_message_requires_src() -> None:
    field = {f.name: f for f in msgspec.structs.fields(lp.Expect)}["src"]
    assert field.required and field.default is msgspec.NODEFAULT
    with pytest.raises(TypeError):
        lp.Expect(request_id="r", blocks=[1])  # type: ignore[call-arg]
    data = _expect_without_src()
    with pytest.raises(msgspec.ValidationError, match="src"):
        msgspec.msgpack.decode(data, type=lp.Expect)
    with pytest.raises(msgspec.ValidationError, match="src"):
        msgspec.msgpack.decode(data, type=lp.LocalUnion)
    with pytest.raises(MessageDecodeError, match="src"):  # what the sidecar's reader raises
        lp.decode(data)


def test_the_sidecar_expect_message_round_trips_with_src() -> None:
    msg = lp.Expect(id=3, request_id="r", blocks=[1, 2], src="prefill-0", have=[7])
    assert lp.decode(lp.encode(msg)) == msg
