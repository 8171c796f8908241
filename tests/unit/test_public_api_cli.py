from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

import kvstream
from kvstream.tools.cli import main


def test_all_names_the_public_surface():
    # Every public attribute but the submodules is named in __all__, and the reverse.
    public = {n for n in dir(kvstream)
              if not n.startswith("_") and not isinstance(getattr(kvstream, n), types.ModuleType)}
    assert set(kvstream.__all__) == public
    assert all(issubclass(getattr(kvstream, n), kvstream.KVStreamError)
               for n in kvstream.__all__ if n.endswith("Error") or n == "TransferTimeout")
    assert kvstream.Client.connect and kvstream.Client.local


def test_import_stays_light():
    code = "import sys, kvstream; print(any(m in sys.modules for m in ('torch', 'ucxx')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plan_json_reference(capsys):
    main(["plan", "--model", "llama-2-70b", "--tokens", "4096", "--bandwidth", "50",
          "--rtt-us", "5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 327_680 and out["request_bytes"] == 1_342_177_280
    assert out["transfer_ms"] == pytest.approx((1_342_177_280 / 50e9 + 5e-6) * 1e3)
    assert out["verdict"] in ("fine", "watch", "does not pay")


def test_plan_text_and_qps(capsys):
    main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--link", "10gbe",
          "--prefill-ms", "100", "--qps", "4"])
    out = capsys.readouterr().out
    assert "131,072 B" in out and "peak load" in out and "share of TTFT" in out


@pytest.mark.parametrize("argv,code", [
    (["plan", "--model", "nope", "--link", "ib-400g"], 1),
    (["plan", "--tokens", "abc"], 2),
    (["plan", "--model", "llama-3-8b"], 1),  # no link
    (["plan", "--layers", "2", "--link", "10gbe"], 1),
])
def test_argument_errors_are_one_line(argv, code, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvstream: error:") and "\n" not in err and "Traceback" not in err


def test_help_reads_whole():
    """Every command's line in `kvstream --help` is its whole first sentence, in plain
    text (click cuts a longer one with '...'; reST markup would show as backticks)."""
    from click.testing import CliRunner

    from kvstream.tools.cli import app

    out = CliRunner().invoke(app, ["--help"], terminal_width=80)
    assert out.exit_code == 0
    listed = out.output.split("Commands:")[1].strip().splitlines()
    assert {ln.split()[0] for ln in listed} == set(app.commands)
    for line in listed:
        assert not line.rstrip().endswith("...") and "``" not in line, line
    for name in app.commands:
        sub = CliRunner().invoke(app, [name, "--help"], terminal_width=80)
        assert sub.exit_code == 0 and "``" not in sub.output, name


def test_log_records_are_one_line_each():
    import io
    import logging

    from kvstream.tools.cli import LOG_FORMAT, OneLineFormatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    log = logging.getLogger("kvstream.test.oneline")
    log.addHandler(handler)
    log.propagate = False
    try:
        raise ValueError("engine said:\n<html>\nbad</html>")
    except ValueError:
        log.exception("prefill leg failed for %s", "x" * 120)
    log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "ERROR kvstream.test.oneline: prefill leg failed" in lines[0]
    assert "Traceback" in lines[0] and "ValueError: engine said:\\n<html>" in lines[0]


def test_vllm_skips_name_the_command_that_enables_them():
    from pathlib import Path

    for path in (Path(__file__).parents[1] / "with_vllm").glob("test_*.py"):
        text = path.read_text()
        if "importorskip(\"vllm" in text:
            assert "README command 3" in text, path.name
