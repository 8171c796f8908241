"""The proxy's pure parts: where a leg goes, what each leg carries, and its settings."""

from __future__ import annotations

import msgspec
import pytest

from kvstream import AgentConfig, ConfigError
from kvstream.control import messages as m
from kvstream.routing.directory import Directory, Instance, pick
from kvstream.tools.cli import main
from tests.fakes import FakeClock


def announce(iid: str, role: str = "decode", endpoint: str = "", load: float = 0.0) -> m.Announce:
    return m.Announce(instance_id=iid, role=role, worker_address=b"", endpoint=endpoint, load=load)


def test_pick_fewest_in_flight_then_announced_load_then_round_robin():
    a, b, c = (Instance(url=u) for u in ("http://a", "http://b", "http://c"))
    assert pick([], {}, 0) is None
    assert pick([a, b], {"http://a": 1}, 0) == b
    # In flight outranks the announced load (ours is exact, theirs a heartbeat old).
    heavy_b = Instance(url="http://b", load=9.0)
    assert pick([a, heavy_b], {"http://a": 1}, 0) == heavy_b
    assert pick([Instance(url="http://a", load=2.0), heavy_b, Instance(url="http://c", load=1.0)],
                {}, 0).url == "http://c"
    # Full ties: turns walk through them in URL order, whatever the input order.
    assert [pick([c, a, b], {}, turn).url for turn in range(4)] == \
        ["http://a", "http://b", "http://c", "http://a"]


def test_directory_routes_fresh_announced_endpoints_and_static_urls():
    clock = FakeClock()
    d = Directory(prefill=["http://p-static:1/"], peer_timeout_s=2.0, clock=clock)
    d.observe(announce("p0", "prefill", "http://p0:8100", load=3.0))
    d.observe(announce("d0", "decode", "http://d0:8200"))
    d.observe(announce("b0", "both", "http://b0:8300"))
    d.observe(announce("quiet", "decode"))  # an agent without an endpoint is not routable
    assert {i.url for i in d.instances("prefill")} == {"http://p-static:1", "http://p0:8100",
                                                      "http://b0:8300"}
    assert {i.url for i in d.instances("decode")} == {"http://d0:8200", "http://b0:8300"}
    assert next(i for i in d.instances("prefill") if i.url == "http://p0:8100").load == 3.0
    clock.advance(1.5)
    d.observe(announce("d0", "decode", "http://d0:8200"))
    clock.advance(1.0)  # p0 and b0 now silent for 2.5 s: stale; d0 heard 1 s ago
    assert [i.url for i in d.instances("prefill")] == ["http://p-static:1"]
    assert [i.url for i in d.instances("decode")] == ["http://d0:8200"]
    d.observe(m.Leave(instance_id="d0"))
    assert d.instances("decode") == []


def test_tp_ranks_collapse_into_one_instance_and_all_get_the_release():
    d = Directory()
    d.observe(announce("eng-tp0", "prefill", "http://p:8100", load=1.0))
    d.observe(announce("eng-tp1", "prefill", "http://p:8100", load=4.0))
    d.observe(announce("engine2", "prefill", "http://q:8100"))
    p = d.instances("prefill")
    assert p[0] == Instance(url="http://p:8100", instance_ids=("eng-tp0", "eng-tp1"), load=4.0)
    assert len(p) == 2
    assert d.engine_instances("eng") == ["eng-tp0", "eng-tp1"]
    assert d.engine_instances("engine2") == ["engine2"]
    assert d.engine_instances("never-seen") == ["never-seen"]


def test_an_unreachable_url_is_not_routed_to_for_peer_timeout():
    clock = FakeClock()
    d = Directory(prefill=["http://p-static:1"], peer_timeout_s=2.0, clock=clock)
    d.observe(announce("p0", "prefill", "http://p0:8100/"))
    d.mark_unreachable("http://p-static:1/")
    d.mark_unreachable("http://p0:8100")
    assert d.instances("prefill") == []
    clock.advance(1.0)
    d.observe(announce("p0", "prefill", "http://p0:8100/"))  # a heartbeat does not undo it
    assert d.instances("prefill") == []
    clock.advance(1.0)
    assert {i.url for i in d.instances("prefill")} == {"http://p-static:1", "http://p0:8100"}


def test_leg_bodies_follow_the_toy_proxy():
    pytest.importorskip("aiohttp")
    from kvstream.proxy import decode_body, decode_only_body, prefill_body

    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 3, "top_p": 0.5,
            "kv_transfer_params": {"client": "junk"}}
    assert prefill_body(body) == {
        "model": "m", "prompt": "x", "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
        "top_p": 0.5, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_request_id": None, "remote_host": None,
            "remote_port": None}}
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"})
    params = {"do_remote_prefill": True, "remote_request_id": "r"}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert decode_body({"prompt": "x"}, None) == {"prompt": "x"}
    assert decode_only_body(body) == {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert body["stream"] is True and body["max_tokens"] == 50  # the client's body is untouched


def test_proxy_no_prefill_setting_is_checked():
    pytest.importorskip("aiohttp")
    from kvstream.proxy import ProxyConfig

    assert ProxyConfig().no_prefill == "decode"
    assert ProxyConfig(no_prefill="reject").no_prefill == "reject"
    with pytest.raises(ConfigError, match="no_prefill"):
        ProxyConfig(no_prefill="recompute")  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["127.0.0.1:8100", "ftp://h:1", "http://h:1/", "http:///v1",
                                 "http://h:1?x=1"])
def test_bad_endpoints_are_refused(url):
    with pytest.raises(ConfigError):
        AgentConfig(instance_id="a", endpoint=url)
    if not url.endswith("/"):  # a static URL's trailing '/' is forgiven (stripped)
        with pytest.raises(ConfigError):
            Directory(decode=[url])


def test_endpoint_travels_in_the_announcement_and_older_fields_default():
    assert AgentConfig(instance_id="a", endpoint="http://10.0.0.5:8100").endpoint
    msg = announce("a", endpoint="https://h/prefix")
    assert m.decode(m.encode(msg)).endpoint == "https://h/prefix"
    old = msgspec.msgpack.encode({"op": "kv.announce", "v": 3, "instance_id": "a",
                                  "role": "decode", "worker_address": b""})
    assert m.decode(old).endpoint == ""


@pytest.mark.parametrize("argv", [["proxy", "--no-nats"], ["proxy", "--no-nats", "--decode", "x"],
                                  ["proxy", "--no-nats", "--nats-url", "nats://h:1"]])
def test_proxy_cli_argument_errors_are_one_line(argv, capsys):
    pytest.importorskip("aiohttp")
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvstream: error:") and "\n" not in err
