"""Settings enter at the command line only: the library reads no environment variables, the one XLA flag
the runner cannot take per executable is set by the CLI helper, and the MoE flags map onto ModelConfig."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jds.bench.cli import MOE_ALIAS, add_moe_flags, moe_overrides, use_graph_update_mode

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = [ROOT / "jds" / "__init__.py", *sorted((ROOT / "jds").glob("*.py")),
           *[p for d in ("ops", "engine", "server") for p in sorted((ROOT / "jds" / d).rglob("*.py"))],
           *sorted((ROOT / "pallas_kernels").rglob("*.py"))]
ENV_ACCESS = re.compile(r"\benviron\b|\bgetenv\b|\bputenv\b|\bunsetenv\b")


def test_library_reads_no_environment() -> None:
    """jds/*.py, jds.ops, jds.engine, jds.server and pallas_kernels take every setting through constructors;
    only the command-line layer (scripts/, jds.bench) touches os.environ."""
    assert len(LIBRARY) > 20 and not any("bench" in p.relative_to(ROOT).parts for p in LIBRARY)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in LIBRARY
            for i, line in enumerate(p.read_text().splitlines(), 1) if ENV_ACCESS.search(line)]
    assert not hits, "\n".join(hits)


def test_graph_update_mode_is_checked() -> None:
    """An unknown XLA command-buffer update mode is a ValueError naming the field; once the backends are up
    (as in this test process) a valid one is refused, since XLA reads it only at client creation."""
    import jax

    with pytest.raises(ValueError, match="graph_update_mode"):
        use_graph_update_mode("SOMETIMES")
    jax.devices()
    with pytest.raises(RuntimeError, match="before JAX initialises"):
        use_graph_update_mode("SKIP_PROFILED")


def test_graph_update_mode_flag_parses() -> None:
    """A fresh process with the flag set runs a step (XLA accepts the flag and value on every backend)."""
    code = ("from jds.bench.cli import use_graph_update_mode; use_graph_update_mode('SKIP_PROFILED'); "
            "import os; assert 'update_mode=SKIP_PROFILED' in os.environ['XLA_FLAGS']; "
            "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x * 2)(jnp.ones(2)).sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("4.0")


def _moe(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_moe_flags(p)
    return moe_overrides(p.parse_args(list(argv)))


def test_moe_flags() -> None:
    assert _moe() == {}
    assert _moe("--moe") == MOE_ALIAS == {"n_routed_experts": 8, "moe_topk": 2, "n_shared_experts": 1}
    assert _moe("--moe-experts", "16", "--moe-topk", "4") == {"n_routed_experts": 16, "moe_topk": 4}
    assert _moe("--moe", "--moe-topk", "3") == {**MOE_ALIAS, "moe_topk": 3}
    with pytest.raises(ValueError, match="--moe-experts"):  # would be silently ignored by a dense model
        _moe("--moe-topk", "4")
    with pytest.raises(SystemExit):
        _moe("--moe-experts", "0")


def test_serve_flags_build_one_runner_config() -> None:
    """scripts/serve.py turns its flags into one RunnerConfig and the MoE overrides, checked at parse time."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import serve
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from jds.config import RunnerConfig, load_model_config

    a = serve.parse_args(["--mode", "fused", "--num-blocks", "12", "--max-num-tokens", "64", "--token-buckets", "16",
                          "--stable-inputs", "--moe-experts", "4", "--moe-topk", "1"])
    assert a.runner_config == RunnerConfig(mode="fused", num_blocks=12, max_num_tokens=64, token_buckets=(16,),
                                           stable_inputs=True)
    assert a.model_overrides == {"n_routed_experts": 4, "moe_topk": 1}
    cfg = load_model_config("v32-tiny", **a.model_overrides)
    assert (cfg.n_routed_experts, cfg.moe_topk, cfg.n_shared_experts) == (4, 1, 1)
    assert serve.parse_args(["--moe"]).model_overrides == MOE_ALIAS
    with pytest.raises(SystemExit):  # a token bucket above --max-num-tokens: a usage error, before building
        serve.parse_args(["--max-num-tokens", "32", "--token-buckets", "64"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--moe-shared", "2"])


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv,pattern", [
    (["--preset", "v5-huge"], "--preset 'v5-huge': choose one of v32-tiny"),  # was a traceback after start-up
    (["--preset", "v32-tiny", "--mtp-layers", "1"], "'mtp_layers': MTP modules exist in DeepSeek-V4's block"),
    (["--config", "/nonexistent/config.json"], "config '/nonexistent/config.json': cannot read it as JSON"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),  # was replaced by the default
    (["--tokenizer", "/nonexistent"], "--tokenizer '/nonexistent': no tokenizer.json there"),  # was byte-level
])
def test_serve_flag_errors_before_building(argv, pattern, capsys) -> None:
    serve = _script("serve")
    with pytest.raises(SystemExit) as e:
        serve.parse_args(argv)
    assert e.value.code == 2 and pattern in capsys.readouterr().err


def test_serve_config_file_errors_are_usage_errors(tmp_path, capsys) -> None:
    serve = _script("serve")
    (tmp_path / "config.json").write_text('{"hidden_size": ')
    with pytest.raises(SystemExit):
        serve.parse_args(["--config", str(tmp_path / "config.json")])
    assert "cannot read it as JSON (Expecting value" in capsys.readouterr().err
    a = serve.parse_args(["--preset", "v4-tiny-block", "--mtp-layers", "1"])  # the valid spelling still parses
    assert a.model_overrides == {"mtp_layers": 1}


def _serve_main(serve, argv: list[str]) -> None:
    import asyncio

    asyncio.run(serve.main(serve.parse_args(["--port", "0", *argv])))


def test_serve_startup_errors_are_one_line(tmp_path, capsys) -> None:
    """Errors found after parsing (a bad tokenizer.json, an unusable --compile-cache, a checkpoint that is not
    one) end start-up with one "serve.py: error:" line and exit code 1, no traceback."""
    serve = _script("serve")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("garbage")
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--runner", "fake", "--tokenizer", str(tmp_path / "tok")], "tokenizer.json: cannot be loaded"),
        (["--runner", "fake", "--compile-cache", str(tmp_path / "afile" / "cc")], "--compile-cache"),
        (["--checkpoint", str(tmp_path / "afile")], "no jds_checkpoint.json"),
    ]
    for argv, pattern in cases:
        with pytest.raises(SystemExit) as e:
            _serve_main(serve, argv)
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.startswith("serve.py: error:") and pattern in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err


def test_other_scripts_check_their_flags(capsys) -> None:
    demo = _script("demo")
    with pytest.raises(SystemExit) as e:  # was numpy's "expected non-negative integer" traceback
        demo.main(["--seed", "-1"])
    assert e.value.code == 2 and "argument --seed: must be >= 0" in capsys.readouterr().err
    make = _script("make_checkpoint")
    with pytest.raises(SystemExit) as e:  # was "checkpoint '<cwd>': exists and is not a jds checkpoint"
        make.main(["--out", ""])
    assert e.value.code == 2 and "--out must not be empty" in capsys.readouterr().err
