"""kvstream's loggers inside a vLLM process come out through vLLM's handler, in its format.

One subprocess (vLLM's logging setup is process-global): vLLM configures its logging as it
does in each engine process, a root handler exists too (it must not get a second copy),
the connector's hook runs twice (both roles may share a process), then vLLM reconfigures
to its JSON formatter and a higher level: kvstream's records follow. The engine tests
check the same lines in real engines' logs (test_vllm_http.py, test_vllm_e2e.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A real vLLM, not a namespace package made of some "vllm" directory (examples/vllm).
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

try:  # tests/with_vllm as a package, or as a plain directory on sys.path
    from . import engines as E
except ImportError:
    import engines as E  # type: ignore[no-redef]

SCRIPT = """
import logging, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, set_vllm_process_name
configure_logging(LoggingConfig(log_level="INFO"))
set_vllm_process_name("Worker")
logging.basicConfig(level="DEBUG", format="ROOT %(message)s", stream=sys.stdout)
from kvstream.adapters.vllm.common import use_vllm_logging
use_vllm_logging()
use_vllm_logging()
log = logging.getLogger("kvstream.agent")
log.info("kvstream one %d", 1)
log.debug("kvstream below vLLM's level")
configure_logging(LoggingConfig(log_level="WARNING", formatter="json"))
log.info("kvstream below the new level")
log.warning("kvstream two")
"""


def test_kvstream_records_go_through_vllms_handler_as_configured_now(tmp_path):
    script = tmp_path / "engine_process.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path,
                         env={**os.environ, "VLLM_LOGGING_COLOR": "0", "VLLM_LOGGING_PREFIX": "",
                              "VLLM_LOGGING_STREAM": "ext://sys.stdout",
                              "VLLM_CONFIGURE_LOGGING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "kvstream" in line]
    assert len(lines) == 2, out.stdout
    text = E.VLLM_LOG_LINE.match(lines[0])
    assert text and (text["process"], text["level"], text["file"], text["message"]) == \
        ("Worker", "INFO", "engine_process.py", "kvstream one 1"), lines[0]
    record = json.loads(lines[1])
    assert (record["name"], record["levelname"], record["message"]) == \
        ("kvstream.agent", "WARNING", "kvstream two")
