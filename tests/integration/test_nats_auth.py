"""Agents on a NATS server that requires credentials and TLS, as deployments run it.

Real ``nats-server`` processes configured for each kind of credential (user and password,
token, NKEY seed) and for TLS with client certificates (made here with ``openssl``), and
the per-instance permissions docs/architecture.md documents: an instance may publish only
to control subjects, its own registry subject and reply inboxes, so another client cannot
forge its announcements or reach its control subject.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from kvstream import ConfigError, KVStreamError, NatsAuth, NatsConnectError, NoPeerError
from kvstream.control import messages as m
from kvstream.control.bus import ControlBus
from kvstream.control.nats_server import EmbeddedNats
from kvstream.control.subjects import Subjects
from tests.fakes import cache, small_layout
from tests.integration.agents import cfg

pytestmark = pytest.mark.anyio


async def _round_trip(url: str, auth: NatsAuth) -> None:
    """A request answered across two authenticated connections."""
    server = await ControlBus.connect(url, name="srv", auth=auth)
    client = await ControlBus.connect(url, name="cli", auth=auth)
    try:
        async def answer(msg: m.ControlUnion, headers: dict[str, str]) -> m.ControlMessage:
            return m.AbortAck(transfer_id="pong")

        await server.serve("t.ping", answer)
        await server.flush()
        reply = await client.request("t.ping", m.Leave(instance_id="x"), timeout=2.0)
        assert reply == m.AbortAck(transfer_id="pong")
    finally:
        await client.close()
        await server.close()


async def test_user_and_password():
    with EmbeddedNats(args=["--user", "kv", "--pass", "s3cret"]) as nats:
        await _round_trip(nats.url, NatsAuth(user="kv", password="s3cret"))
        with pytest.raises(NatsConnectError) as err:
            await ControlBus.connect(nats.url, name="bad", timeout=3,
                                     auth=NatsAuth(user="kv", password="wrong"))
        assert err.value.cause == "auth"


async def test_token_and_the_environment():
    with EmbeddedNats(args=["--auth", "tok-123"]) as nats:
        await _round_trip(nats.url, NatsAuth.from_env(environ={"KVSTREAM_NATS_TOKEN": "tok-123"}))
        with pytest.raises(NatsConnectError) as err:
            await ControlBus.connect(nats.url, name="none", timeout=3)
        assert err.value.cause == "auth"


def _user_nkey(tmp_path: Path) -> tuple[str, str]:
    """A fresh user NKEY: (public key for the server, seed file for the client)."""
    import os

    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    path = tmp_path / "user.nk"
    path.write_bytes(seed)
    return public, str(path)


async def test_nkey_seed(tmp_path: Path):
    public, seed_file = _user_nkey(tmp_path)
    with EmbeddedNats(config=f"authorization {{ users = [ {{ nkey: {public} }} ] }}\n") as nats:
        await _round_trip(nats.url, NatsAuth(nkey_seed=seed_file))
        (tmp_path / "other").mkdir()
        _, other = _user_nkey(tmp_path / "other")  # a valid seed the server does not know
        with pytest.raises(NatsConnectError) as err:
            await ControlBus.connect(nats.url, name="stranger", timeout=3,
                                     auth=NatsAuth(nkey_seed=other))
        assert err.value.cause == "auth"


def test_auth_settings_are_checked_and_secrets_not_shown(tmp_path: Path):
    with pytest.raises(ConfigError, match="one NATS identity"):
        NatsAuth(token="t", nkey_seed="x")
    with pytest.raises(ConfigError, match="go together"):
        NatsAuth(user="u")
    with pytest.raises(ConfigError, match="does not exist"):
        NatsAuth(creds=str(tmp_path / "missing.creds")).connect_options()
    with pytest.raises(ConfigError, match="unknown NATS auth"):
        NatsAuth.from_env({"pasword": "typo"})
    shown = repr(NatsAuth(user="u", password="hunter2"))
    assert "hunter2" not in shown and "u" in shown
    assert "s3kr1t" not in str(cfg("a", EmbeddedNats(), nats_auth=NatsAuth(token="s3kr1t")))


# -- TLS -------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made now."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             "/CN=kvstream-test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", "san.ext",
                 "-out", f"{name}.pem", cwd=d)
    return d


def _tls_config(d: Path) -> str:
    return (f'tls {{ cert_file: "{d}/server.pem", key_file: "{d}/server.key", '
            f'ca_file: "{d}/ca.pem", verify: true }}\n')


async def test_mutual_tls(certs: Path):
    with EmbeddedNats(config=_tls_config(certs)) as nats:
        good = NatsAuth(tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "client.pem"),
                        tls_key=str(certs / "client.key"))
        await _round_trip(nats.url, good)
        with pytest.raises(NatsConnectError):  # no client certificate: the server refuses
            await ControlBus.connect(nats.url, name="anon", timeout=3,
                                     auth=NatsAuth(tls_ca=str(certs / "ca.pem")))


# -- a whole transfer under per-instance permissions ------------------------------------
def _permissions(ns: str, users: dict[str, str]) -> str:
    """docs/architecture.md's layout: each instance publishes to control subjects, its own
    registry subject and inboxes; it subscribes to its own control subject, the registry
    and its own inboxes (nobody reads another's answers). ``intruder`` may only use inboxes,
    and read only its own."""
    s = Subjects(ns)
    entries = []
    for user, password in users.items():
        if user == "intruder":
            pub, sub = ["_INBOX.>"], [f"{s.inbox(user)}.>"]
        else:
            allowed = s.permissions(user)
            pub, sub = allowed["publish"], allowed["subscribe"]
        entries.append(f'{{ user: {user}, password: {password}, permissions: '
                       f'{{ publish: {{ allow: {pub} }}, subscribe: {{ allow: {sub} }} }} }}')
    return "authorization { users = [\n" + "\n".join(entries) + "\n] }\n"


async def test_push_under_per_instance_permissions_and_an_intruder_is_shut_out(certs: Path):
    from kvstream import Agent

    users = {"pp": "pw-p", "dd": "pw-d", "intruder": "pw-x", "ins": "pw-i"}
    config = _permissions("default", users) + _tls_config(certs)
    tls = {"tls_ca": str(certs / "ca.pem"), "tls_cert": str(certs / "client.pem"),
           "tls_key": str(certs / "client.key")}
    with EmbeddedNats(config=config) as nats:
        lay = small_layout()
        p_auth = NatsAuth(user="pp", password="pw-p", **tls)
        d_auth = NatsAuth(user="dd", password="pw-d", **tls)
        async with Agent(cfg("pp", nats, nats_auth=p_auth), layout=lay,
                         kv_caches=cache(lay, 8, fill=True)) as p, \
                Agent(cfg("dd", nats, nats_auth=d_auth), layout=lay,
                      kv_caches=cache(lay, 8, fill=False)) as d:
            rx = d.expect("r", [1, 2], src=p.instance_id)
            tx = await p.push("r", "dd", [3, 4])
            tx.all_ready()
            with anyio.fail_after(10):
                assert (await rx.wait()).ok and (await tx.wait()).ok
            intruder = await ControlBus.connect(nats.url, name="x", auth=NatsAuth(
                user="intruder", password="pw-x", **tls),
                inbox_prefix=Subjects("default").inbox("intruder"))
            try:
                # a forged announcement and a forged abort never reach the agents
                await intruder.publish(Subjects("default").registry("evil"), m.Announce(
                    instance_id="evil", role="decode", worker_address=b"\x00" * 8,
                    layout=lay, num_blocks=8, load=0.0, heartbeat_s=0.5, seq=1))
                with pytest.raises(NoPeerError):
                    await intruder.request(Subjects("default").control("dd"), m.Abort(
                        transfer_id="", request_id="r", reason="forged", by="pp"),
                        timeout=1.0)
                await anyio.sleep(0.5)
                assert [a.instance_id for a in d.peers()] == ["pp"]
            finally:
                await intruder.close()
            # An insider (a permitted agent of its own) pushing first into a reservation
            # made for pp: refused, and pp's push then lands.
            async with Agent(cfg("ins", nats, nats_auth=NatsAuth(
                    user="ins", password="pw-i", **tls)), layout=lay,
                    kv_caches=cache(lay, 8, fill=True)) as ins:
                with anyio.fail_after(10):
                    while not (d.registry.alive("ins") and ins.registry.alive("dd")):
                        await anyio.sleep(0.02)
                forbidden = d.statistics().forbidden_requests
                rx = d.expect("r2", [5, 6], src=p.instance_id)
                with pytest.raises(KVStreamError, match="expected from pp"):
                    await ins.push("r2", "dd", [3, 4])
                assert d.statistics().forbidden_requests == forbidden + 1
                tx = await p.push("r2", "dd", [3, 4])
                tx.all_ready()
                with anyio.fail_after(10):
                    assert (await rx.wait()).ok and (await tx.wait()).ok
                assert p.memory is not None and d.memory is not None
                assert all(p.memory.read_block(i, 3).equal(d.memory.read_block(i, 5))
                           for i in range(lay.num_layers))


def test_the_cli_takes_credentials_from_options_and_the_environment():
    """``kvstream doctor`` (like ``sidecar`` and ``proxy``) connects with --nats-* options,
    and with KVSTREAM_NATS_* variables for what they leave out."""
    import json
    import os
    import sys

    with EmbeddedNats(args=["--user", "kv", "--pass", "s3cret"]) as nats:
        def doctor(*args: str, **env: str) -> dict:
            out = subprocess.run(
                [sys.executable, "-m", "kvstream.tools.cli", "doctor", "--nats-url", nats.url,
                 "--no-link-check", "--json", *args], capture_output=True, text=True,
                env={**os.environ, **env}, timeout=120)
            return json.loads(out.stdout)["nats"]

        assert doctor("--nats-user", "kv", KVSTREAM_NATS_PASSWORD="s3cret")["connected"]
        assert not doctor("--nats-user", "kv", "--nats-password", "wrong")["connected"]


def _jwt(claims: dict, signer) -> str:
    """A NATS JWT (v2): base64url header and claims, signed with the issuer's NKEY."""
    import base64
    import hashlib
    import json
    import time

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    claims = {"iat": int(time.time()), **claims}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims).encode()).digest()
                                     ).decode().rstrip("=")
    head = b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = b64(json.dumps(claims).encode())
    return f"{head}.{body}.{b64(signer.sign(f'{head}.{body}'.encode()))}"


async def test_creds_file_on_an_operator_mode_server(tmp_path: Path):
    """A ``.creds`` file (user JWT + seed) against a server trusting an operator, with the
    account preloaded: the JWTs are made and signed here."""
    import os

    import nkeys

    def keypair(prefix: int):
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        kp = nkeys.from_seed(bytearray(seed))
        return kp, kp.public_key.decode(), seed.decode()

    op, op_pub, _ = keypair(nkeys.PREFIX_BYTE_OPERATOR)
    acc, acc_pub, _ = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, user_pub, user_seed = keypair(nkeys.PREFIX_BYTE_USER)
    unlimited = {"subs": -1, "data": -1, "payload": -1}
    operator_jwt = _jwt({"iss": op_pub, "sub": op_pub, "name": "op",
                         "nats": {"type": "operator", "version": 2}}, op)
    account_jwt = _jwt({"iss": op_pub, "sub": acc_pub, "name": "kvstream",
                        "nats": {"type": "account", "version": 2, "limits": {
                            **unlimited, "conn": -1, "leaf": -1, "imports": -1,
                            "exports": -1, "wildcards": True}}}, op)
    user_jwt = _jwt({"iss": acc_pub, "sub": user_pub, "name": "agent",
                     "nats": {"type": "user", "version": 2, "pub": {}, "sub": {},
                              **unlimited}}, acc)
    creds = tmp_path / "agent.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n"
                     f"\n-----BEGIN USER NKEY SEED-----\n{user_seed}\n------END USER NKEY SEED------\n")
    config = (f"operator: {operator_jwt}\nresolver: MEMORY\n"
              f"resolver_preload: {{ {acc_pub}: {account_jwt} }}\n")
    with EmbeddedNats(config=config, jetstream=False) as nats:
        await _round_trip(nats.url, NatsAuth(creds=str(creds)))
        with pytest.raises(NatsConnectError) as err:  # a seed without a JWT the server trusts
            _, _, stranger = keypair(nkeys.PREFIX_BYTE_USER)
            (tmp_path / "stranger.nk").write_text(stranger)
            await ControlBus.connect(nats.url, name="stranger", timeout=3,
                                     auth=NatsAuth(nkey_seed=str(tmp_path / "stranger.nk")))
        assert err.value.cause == "auth"
