"""One client surface: the in-process and the sidecar client take the same calls."""

from __future__ import annotations

import inspect
import math

import pytest

from kvstream.client import _LocalClient, _SidecarClient
from kvstream.client_api import TransferClient
from kvstream.config import check_timeout

METHODS = [n for n, v in vars(TransferClient).items()
           if inspect.iscoroutinefunction(v) and not n.startswith("_")]


def _params(fn) -> list[tuple[str, object, object, str]]:
    return [(p.name, p.kind, p.default, str(p.annotation))
            for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_names_every_transfer_call() -> None:
    assert set(METHODS) == {"register_kv", "expect", "push", "offer", "pull", "statistics"}


@pytest.mark.parametrize("client", [_LocalClient, _SidecarClient])
@pytest.mark.parametrize("name", METHODS)
def test_both_clients_match_the_protocol(client: type, name: str) -> None:
    assert _params(getattr(client, name)) == _params(getattr(TransferClient, name)), name


def _arguments(fn) -> dict[str, tuple[object, object]]:
    return {p.name: (p.kind, p.default) for p in inspect.signature(fn).parameters.values()}


@pytest.mark.parametrize("name", ["expect", "push", "offer", "pull"])
def test_the_agent_takes_the_same_arguments(name: str) -> None:
    """``Agent`` has the transfer calls too (``expect``/``offer`` plain, they do no I/O):
    the same names, kinds and defaults, so code moves between the two unchanged."""
    from kvstream import Agent

    assert _arguments(getattr(Agent, name)) == _arguments(getattr(TransferClient, name)), name


def test_a_changed_signature_is_caught() -> None:
    async def push(self, request_id: str, dst: str, src_blocks, *, mode: str = "eager"): ...

    assert _params(push) != _params(TransferClient.push)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "5"])
def test_deadlines_that_would_never_pass_are_refused(bad: object) -> None:
    from kvstream import ConfigError

    with pytest.raises(ConfigError, match="timeout"):
        check_timeout(bad)  # type: ignore[arg-type]
    assert check_timeout(None) is None and check_timeout(2.5) == 2.5


def test_errors_cross_the_sidecar_socket_whole() -> None:
    """An agent error reaches the engine behind a sidecar with its class and fields."""
    import kvstream
    from kvstream.client import _error
    from kvstream.sidecar import protocol as lp

    cases = [kvstream.InvalidBlockError("bad ids", block_ids=[7, 9], limit=8),
             kvstream.DuplicateRequestError("again", request_id="r1", peer="p0"),
             kvstream.CapacityError("full", what="transfers", limit=1024),
             kvstream.NoPeerError("gone", peer="d0", no_responders=True),
             kvstream.ClosedError("not started")]
    for exc in cases:
        wire = lp.Error(id=1, kind=type(exc).__name__, message=str(exc), fields=exc.fields())
        back = lp.decode(lp.frame(wire)[4:])
        got = _error(back.kind, back.message, back.fields)
        assert type(got) is type(exc) and str(got) == str(exc)
        assert vars(got) == vars(exc), type(exc).__name__
    assert isinstance(cases[1], kvstream.ConfigError)  # callers that caught ConfigError still do
