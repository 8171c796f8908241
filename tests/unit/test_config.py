"""AgentConfig refuses times that would never pass, and keeps NATS secrets out of sight."""

from __future__ import annotations

import math

import pytest

from kvstream import AgentConfig, ConfigError, NatsAuth


@pytest.mark.parametrize("field", ["heartbeat_s", "peer_timeout_s", "request_timeout_s",
                                   "transfer_timeout_s", "reservation_timeout_s",
                                   "staging_wait_s", "lease_s"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_times_must_be_positive_and_finite(field: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=field):
        AgentConfig(instance_id="a", **{field: bad})  # type: ignore[arg-type]


def test_nats_auth_comes_from_the_environment_under_given_values() -> None:
    env = {"KVSTREAM_NATS_USER": "env-user", "KVSTREAM_NATS_PASSWORD": "env-pass",
           "KVSTREAM_NATS_TLS_CA": "/etc/ca.pem"}
    auth = NatsAuth.from_env({"user": "given"}, environ=env)
    assert (auth.user, auth.password, auth.tls_ca, auth.tls) == ("given", "env-pass",
                                                                 "/etc/ca.pem", True)
    cfg = AgentConfig(instance_id="a", nats_auth=auth)
    assert "env-pass" not in repr(cfg) and "***" in repr(cfg)
