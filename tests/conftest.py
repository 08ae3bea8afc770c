"""Session-wide test setup: one persistent XLA compilation cache for the whole run.

Many tests build runners / layers of the same tiny configs, and each one's jits are its own function objects, so
without a cache every test compiles the same executables again. With ``jax_compilation_cache_dir`` set, a
computation whose HLO (and compile options) equals one compiled earlier in the session is loaded instead of
compiled: every test still traces and lowers its own steps (all of jds's Python runs), only XLA's backend compile
of an identical module is skipped. The directory is made by the controlling process (shared by the xdist
workers, which inherit the variable) and removed at its end. Set only in this process's jax config, never in the
environment jax reads, so subprocesses (servers, scripts, the mesh workers) compile as before.

``JDS_TEST_XLA_CACHE=0`` turns the cache off. Tests that observe XLA compiling (dumps, compile counts) take the ``no_compile_cache`` fixture.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_DIR_VAR = "JDS_TEST_XLA_CACHE_DIR"  # not a variable jax reads


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("JDS_TEST_XLA_CACHE") == "0":  # off: every test compiles its own executables
        return
    if not os.environ.get(_DIR_VAR):  # the controller (or a run without xdist): make the session's directory
        os.environ[_DIR_VAR] = tempfile.mkdtemp(prefix="jds_test_xla_cache_")
        config._jds_xla_cache_owned = os.environ[_DIR_VAR]  # type: ignore[attr-defined]
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_DIR_VAR])
    # compiles under 0.2 s (eager primitives, mostly) are not worth a cache entry: measured the same CPU time as no
    # threshold on the runner tests, and no overhead on the eager-heavy ones (test_v4_decoder, test_compare_torch)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config: pytest.Config) -> None:
    owned = getattr(config, "_jds_xla_cache_owned", None)
    if owned:
        shutil.rmtree(owned, ignore_errors=True)
        os.environ.pop(_DIR_VAR, None)


@pytest.fixture
def no_compile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compile in the test is a real XLA compile (no persistent-cache hit): for tests that count compiles or
    read what XLA writes while compiling."""
    from jax._src import compilation_cache

    monkeypatch.setattr(compilation_cache, "is_cache_used", lambda backend: False)
