"""``scripts/serve.py --model HF_DIR``: a synthetic HF checkpoint directory (tests/test_convert_checkpoint's
writer) with a tokenizer and a Jinja chat template (tests/test_chat_template's) is converted on first use,
cached (beside it or under --cache-dir), reused on the next start, cut to --num-layers, and served with the
directory's tokenizer and template."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jds import hf_import
from jds.checkpoint import read_meta
from jds.model import Decoder
from jds.runner import ModelRunner
from jds.server.tokenizer import HFTokenizer, JinjaChatTemplate, load_tokenizer
from tests.test_chat_template import MESSAGES, expected_ids, write_tokenizer_dir
from tests.test_convert_checkpoint import tiny_cfg
from tests.test_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def _serve_module():
    spec = importlib.util.spec_from_file_location("serve_script", ROOT / "scripts" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SERVE = _serve_module()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A 2-layer FP8 V3.2 HF directory with a tokenizer and a chat template."""
    d = tmp_path_factory.mktemp("models") / "tiny-v32"
    hf_import.export_hf(Decoder(tiny_cfg("v32", moe=False), seed=3), d)
    write_tokenizer_dir(d)
    return d


def prepare(*argv: str) -> tuple[argparse.Namespace, list[str]]:
    a = SERVE.parse_args(list(argv))
    said: list[str] = []
    SERVE.prepare_model_dir(a, said.append)
    return a, said


def test_convert_on_first_use_then_cache_hit(tmp_path, hf_dir, monkeypatch) -> None:
    cache = tmp_path / "cache"
    a, said = prepare("--model", str(hf_dir), "--cache-dir", str(cache), "--num-layers", "1")
    assert Path(a.checkpoint).parent == cache and any("converting" in m for m in said)
    assert a.tokenizer == str(hf_dir) and a.served_model_name == "tiny-v32"
    meta = read_meta(a.checkpoint)
    assert meta["extra"]["quantization"]["scale_fmt"] == "ue8m0" and meta["extra"]["layers"] == 1
    # the second start converts nothing
    monkeypatch.setattr(hf_import, "convert_hf_checkpoint", lambda *a, **k: pytest.fail("converted again"))
    b, said = prepare("--model", str(hf_dir), "--cache-dir", str(cache), "--num-layers", "1")
    assert b.checkpoint == a.checkpoint and any("using the cached conversion" in m for m in said)
    monkeypatch.undo()
    # the model, tokenizer and template the server gets
    runner = ModelRunner.build(checkpoint=b.checkpoint, num_blocks=4, max_num_seqs=1, max_num_tokens=16,
                               max_model_len=64)
    assert runner.model.cfg.n_layers == 1 and runner.model.cfg.numerics.fp8_linear
    tok = load_tokenizer(b.tokenizer, bos_token_id=runner.bos_token_id, eos_token_id=runner.eos_token_id)
    assert isinstance(tok, HFTokenizer) and isinstance(tok.chat_format, JinjaChatTemplate)
    assert "Jinja chat template" in SERVE.describe_tokenizer(tok, runner)
    # another layer count is another cache entry
    c, said = prepare("--model", str(hf_dir), "--cache-dir", str(cache), "--num-layers", "2")
    assert c.checkpoint != a.checkpoint and read_meta(c.checkpoint)["extra"]["layers"] == 2


def test_default_cache_is_beside_the_model_and_follows_the_source(tmp_path, hf_dir) -> None:
    import shutil

    src = tmp_path / "m"
    shutil.copytree(hf_dir, src)
    a, _ = prepare("--model", str(src), "--num-layers", "1")
    assert Path(a.checkpoint).parent == Path(str(src) + ".jds")
    shard = sorted(src.glob("*.safetensors"))[0]
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))  # a changed shard: not the cached one
    b, said = prepare("--model", str(src), "--num-layers", "1")
    assert b.checkpoint != a.checkpoint and any("converting" in m for m in said)


@pytest.mark.parametrize("argv,pattern", [
    (["--num-layers", "1"], "--num-layers needs --model"),
    (["--cache-dir", "x"], "--cache-dir needs --model"),
    (["--model", "x", "--preset", "v32-tiny"], "--preset cannot be combined"),
    (["--model", "x", "--checkpoint", "y"], "--checkpoint cannot be combined"),
    (["--model", "x", "--runner", "fake"], "needs --runner model"),
    (["--dequantize"], "--dequantize needs --model"),
    (["--numerics", "bf16"], "--numerics needs --model"),
    (["--no-indexer-hadamard"], "--no-indexer-hadamard needs --model"),
    (["--model", "x", "--numerics-field", "hadamard=false"], "FIELD=VALUE with FIELD one of"),
    (["--model", "x", "--numerics-field", "indexer_fp8=maybe"], "indexer_fp8: expected true or false"),
    (["--model", "x", "--numerics-field", "kv_cache_dtype=fp4"], "kv_cache_dtype"),
    (["--model", "x", "--numerics-field", "fp8_linear=false"], "fp8_linear"),
    # was a traceback after the conversion (a v32-tiny preset built with MTP layers)
    (["--model", "x", "--mtp-layers", "1"], "--mtp-layers cannot be combined"),
])
def test_flag_errors(argv, pattern, capsys) -> None:
    with pytest.raises(SystemExit):
        SERVE.parse_args(argv)
    assert pattern in capsys.readouterr().err


def test_numerics_departures_are_explicit(tmp_path, hf_dir) -> None:
    """By default the checkpoint's numerics: FP8 weights as stored, the indexer's Hadamard, its scale format.
    Each departure is a named flag, and a departed conversion is its own cache entry."""
    cache = tmp_path / "cache"
    base, _ = prepare("--model", str(hf_dir), "--cache-dir", str(cache), "--num-layers", "1")
    n = read_meta(base.checkpoint)["config"]["numerics"]
    assert n["fp8_linear"] and n["indexer_hadamard"] and n["act_scale_fmt"] == "ue8m0"
    dep, _ = prepare("--model", str(hf_dir), "--cache-dir", str(cache), "--num-layers", "1", "--dequantize",
                     "--no-indexer-hadamard", "--numerics-field", "kv_cache_dtype=bfloat16",
                     "--numerics-field", "indexer_fp8=false")
    assert dep.checkpoint != base.checkpoint
    n = read_meta(dep.checkpoint)["config"]["numerics"]
    assert (n["fp8_linear"], n["indexer_hadamard"], n["kv_cache_dtype"], n["indexer_fp8"]) == (
        False, False, "bfloat16", False)


def test_bad_model_dir_names_the_problem(tmp_path, hf_dir, capsys) -> None:
    with pytest.raises(SystemExit):  # at parse time: before the tokenizer's warning, before anything is built
        prepare("--model", str(tmp_path))
    assert "not a HF checkpoint directory (no config.json)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'layers'"):
        prepare("--model", str(hf_dir), "--cache-dir", str(tmp_path / "c"), "--num-layers", "5")
    assert not any((tmp_path / "c").iterdir())  # nothing half-written in the cache


def test_damaged_model_dir_files_are_named(tmp_path, hf_dir) -> None:
    """config.json that is not an object (was an AttributeError traceback), a tokenizer.json the tokenizers
    package cannot read (was its bare Exception), no tokenizer.json at all (said, not silently byte-level)."""
    import shutil

    bad = tmp_path / "listcfg"
    bad.mkdir()
    (bad / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="config.json is not a JSON object"):
        prepare("--model", str(bad), "--cache-dir", str(tmp_path / "c"))
    src = tmp_path / "m"
    shutil.copytree(hf_dir, src)
    (src / "tokenizer.json").write_text("garbage")
    with pytest.raises(ValueError, match=r"m/tokenizer\.json: cannot be loaded"):
        prepare("--model", str(src), "--cache-dir", str(tmp_path / "c"), "--num-layers", "1")
    assert not any((tmp_path / "c").iterdir())
    (src / "tokenizer.json").unlink()
    (src / "tokenizer_config.json").unlink()
    _, said = prepare("--model", str(src), "--cache-dir", str(tmp_path / "c"), "--num-layers", "1")
    assert any(m.startswith("WARNING:") and "no tokenizer.json" in m for m in said), said


def _start(argv: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve.py"), "--port", str(port), *argv],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, "server exited:\n" + log_path.read_text()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server never became healthy:\n" + log_path.read_text())


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.slow
def test_serve_model_dir_end_to_end(tmp_path, hf_dir) -> None:
    """Two starts of the real server on the HF directory: the first converts, the second reuses; the chat
    route feeds the model the directory's template, token for token (by count: the ids are checked in
    tests/test_chat_template)."""
    argv = ["--model", str(hf_dir), "--cache-dir", str(tmp_path / "cache"), "--num-layers", "1",
            "--num-blocks", "8", "--max-num-seqs", "2", "--max-num-tokens", "64", "--max-model-len", "128"]
    for i, expect in enumerate(("converting", "using the cached conversion")):
        log = tmp_path / f"serve{i}.log"
        proc, base = _start(argv, log)
        try:
            body = {"model": "tiny-v32", "messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(expected_ids(MESSAGES))
        finally:
            _stop(proc)
        text = log.read_text()
        assert expect in text and "Jinja chat template" in text, text
