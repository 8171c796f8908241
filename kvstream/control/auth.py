"""How an agent, sidecar or proxy proves who it is to NATS, and over what (TLS).

Every credential NATS users already have: user and password, a token, an NKEY seed file,
a ``.creds`` file (JWT + seed, operator mode), and TLS with a CA and optionally a client
certificate (mutual TLS). Secrets are best given as files or environment variables
(``KVSTREAM_NATS_*``), so they stay out of process listings; ``repr`` never shows them.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import msgspec

from kvstream._exceptions import ConfigError

__all__ = ["ENV_PREFIX", "NatsAuth"]

ENV_PREFIX: Final = "KVSTREAM_NATS_"
_SECRETS: Final = ("password", "token")
_FILES: Final = ("nkey_seed", "creds", "tls_ca", "tls_cert", "tls_key")


class NatsAuth(msgspec.Struct, frozen=True, kw_only=True, repr_omit_defaults=True):
    """NATS credentials and TLS; every field is optional (a server without auth needs none)."""

    user: str = ""
    password: str = ""  # with ``user``; a URL's ``nats://user:pass@host`` works too
    token: str = ""
    nkey_seed: str = ""  # path of a file holding a user NKEY seed ("SU...")
    creds: str = ""  # path of a .creds file (user JWT and seed; operator-mode servers)
    tls_ca: str = ""  # CA bundle the server's certificate must chain to (turns TLS on)
    tls_cert: str = ""  # client certificate for mutual TLS, with ``tls_key``
    tls_key: str = ""
    tls_hostname: str = ""  # the name to verify when the URL names an IP address

    def __post_init__(self) -> None:
        if bool(self.user) != bool(self.password):
            raise ConfigError("NATS user and password go together")
        identities = [n for n in ("user", "token", "nkey_seed", "creds") if getattr(self, n)]
        if len(identities) > 1:
            raise ConfigError(f"one NATS identity at a time, not {' and '.join(identities)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("a TLS client certificate needs its key (tls_cert with tls_key)")

    def __repr__(self) -> str:
        shown = {f: ("***" if f in _SECRETS else getattr(self, f))
                 for f in self.__struct_fields__ if getattr(self, f)}
        return f"NatsAuth({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    __str__ = __repr__

    @classmethod
    def from_env(cls, given: Mapping[str, str] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> NatsAuth:
        """``given`` values first, then ``KVSTREAM_NATS_<FIELD>`` variables (e.g.
        ``KVSTREAM_NATS_PASSWORD``, ``KVSTREAM_NATS_CREDS``)."""
        given = given or {}
        unknown = set(given) - set(cls.__struct_fields__)
        if unknown:
            raise ConfigError(f"unknown NATS auth setting(s) {sorted(unknown)}; known: "
                              f"{', '.join(cls.__struct_fields__)}")
        env = os.environ if environ is None else environ
        values = {f: str(given.get(f) or env.get(ENV_PREFIX + f.upper(), ""))
                  for f in cls.__struct_fields__}
        return cls(**values)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.aio.client.Client.connect``; files are checked here,
        so a missing one is named before any connection is tried."""
        for name in _FILES:
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"NATS {name.replace('_', ' ')} file {path!r} does not exist")
        opts: dict[str, Any] = {}
        if self.user:
            opts.update(user=self.user, password=self.password)
        if self.token:
            opts["token"] = self.token
        if self.nkey_seed:
            opts["nkeys_seed"] = self.nkey_seed
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.tls:
            opts["tls"] = self.ssl_context()
            if self.tls_hostname:
                opts["tls_hostname"] = self.tls_hostname
        return opts

    def ssl_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"NATS TLS set-up failed: {exc}") from exc
        return ctx
