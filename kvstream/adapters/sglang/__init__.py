"""kvstream as an SGLang disaggregation transfer backend (issue 19), pinned to sglang 0.5.23.

``pip install 'kvstream[sglang]'`` installs the ``sglang.srt.plugins`` entry point
(``plugin.register``): then ``--disaggregation-transfer-backend kvstream`` is a valid
choice on both servers, with nothing of SGLang edited. ``conn`` holds the classes SGLang
builds (manager, sender, receiver, bootstrap server; it imports SGLang), ``notes`` what
the two sides tell each other, ``memory`` SGLang's raw buffers as kvstream tensors.
Settings come from the environment: ``KVSTREAM_NATS_URL`` (default: the local server,
embedded if none), ``KVSTREAM_NAMESPACE``, ``KVSTREAM_NATS_*`` credentials,
``KVSTREAM_SGLANG_HOST`` (the prefill's host as the router names it, when its ``--host``
is a wildcard), ``KVSTREAM_PEER_TIMEOUT_S``, ``KVSTREAM_TRANSFER_TIMEOUT_S``,
``KVSTREAM_LEASE_S``.
"""
