"""Session-wide test setup: one persistent XLA compilation cache for the whole run.

Many tests build runners / layers of the same tiny configs, and each one's jits are its own function objects, so
without a cache every test compiles the same executables again. With ``jax_compilation_cache_dir`` set, a
computation whose HLO (and compile options) equals one compiled earlier in the session is loaded instead of
compiled: every test still traces and lowers its own steps (all of jds's Python runs), only XLA's backend compile
of an identical module is skipped. The directory is made by the controlling process (shared by the xdist
workers, which inherit the variable) and removed at its end. Set only in this process's jax config, never in the
environment jax reads, so subprocesses (servers, scripts, the mesh workers) compile as before.

Kernel tests' interpret-mode runs outside ``tests/ci_budget.py``'s list are marked ``slow`` (CI time budget).

``NPROC`` (XLA's CPU thread pool, unless set) is at least ``INTERPRET_POOL_THREADS``: GPU interpret mode's barrier
waits hold pool threads (``pytest_configure``).

``JDS_TEST_XLA_CACHE=0`` turns the cache off. Tests that observe XLA compiling (dumps, compile counts) take the ``no_compile_cache`` fixture.

On a machine without a jax GPU plugin, XLA's CPU backend compiles at LLVM optimisation level 0 in the test processes
(``--xla_backend_optimization_level=0`` in ``XLA_FLAGS``, set before jax starts its backend, so also in the
subprocesses the tests start): the suite is
bound by compiling thousands of small executables, not by running them; at level 0 the same suite ran 15-22% faster
on a 2-core machine (compile-bound files, the interpret-mode kernels and the subprocess tests alike, 2026-12-02).
What the tests check does not depend on it: float results are compared with tolerances derived from their formats
(codegen may reorder float arithmetic on any CPU), exact comparisons are of integers or of one program against
itself. ``JDS_TEST_XLA_FAST_COMPILE=0`` compiles at XLA's default level instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_DIR_VAR = "JDS_TEST_XLA_CACHE_DIR"  # not a variable jax reads


_FAST_COMPILE = "--xla_backend_optimization_level=0"
INTERPRET_POOL_THREADS = 32  # at least this many CPU-client pool threads in the tests (``NPROC``, below)


def _gpu_plugin_installed() -> bool:
    """A jax GPU plugin is importable: the flag would also reach XLA's GPU codegen, so it stays off there (the
    gpu-marked tests run XLA's GPU kernels as the benchmarks and the server do)."""
    import importlib.util

    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_plugins", "jax_cuda13_plugin", "jax_cuda12_plugin"))


def pytest_configure(config: pytest.Config) -> None:
    if (os.environ.get("JDS_TEST_XLA_FAST_COMPILE") != "0" and _FAST_COMPILE not in os.environ.get("XLA_FLAGS", "")
            and (os.environ.get("JAX_PLATFORMS") == "cpu" or not _gpu_plugin_installed())):
        # before any backend starts (jax reads XLA_FLAGS once, when it creates the first client)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
    # XLA's CPU client sizes its thread pool from NPROC (else one thread per core), read when the client starts:
    # GPU interpret mode runs a kernel's simulated threads as computations whose barrier waits block pool threads, so
    # with 2 of them (a 2-core machine) the FP8 GEMM's staged or ring scales with one row tile deadlocked (the
    # waiting threads were pool threads, the computations they waited for queued; with a pool of 16 the same calls
    # ran in 2 s, 2026-12-06). Raised, never lowered; inherited by the xdist workers and the subprocesses the tests
    # start. ``interpret_barrier_forms`` relies on it
    nproc = os.environ.get("NPROC", "")
    os.environ["NPROC"] = str(max(int(nproc) if nproc.isdigit() else 0, os.cpu_count() or 1, INTERPRET_POOL_THREADS))
    import jax

    # CPU computations run inline on the calling thread instead of on the CPU client's pool (as many threads as
    # cores). GPU interpret mode runs each simulated thread of a kernel as its own computation, from a Python thread,
    # while the kernel's computation waits in a callback. With a pool of 2 (a 2-core machine), a simulated thread
    # waited at a barrier for a thread whose computation found no free pool thread: a worker hung in
    # test_v32_padded_heads_and_splits (2026-12-02; py-spy: two pool threads in callbacks, one computation queued).
    # XLA runs a computation inline when the client is synchronous and nothing is queued before it. Suite time was
    # the same either way (three files, and three of the slowest tests, each run both ways on a 2-core machine).
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    if os.environ.get("JDS_TEST_XLA_CACHE") == "0":  # off: every test compiles its own executables
        return
    if not os.environ.get(_DIR_VAR):  # the controller (or a run without xdist): make the session's directory
        os.environ[_DIR_VAR] = tempfile.mkdtemp(prefix="jds_test_xla_cache_")
        config._jds_xla_cache_owned = os.environ[_DIR_VAR]  # type: ignore[attr-defined]
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


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by ``-m``
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Interpret-mode runs of ``tests/test_kernel_*.py`` not listed in ``tests/ci_budget.py``: ``slow``. A listed
    run that a whole-directory collection does not find is an error (a renamed test or parameter)."""
    from tests.ci_budget import CI_INTERPRET

    seen = set()
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not item.path.name.startswith("test_kernel_") or params.get("mode") != "interpret":
            continue
        key = item.nodeid.rsplit("/", 1)[-1]  # file.py::name[params], as CI_INTERPRET lists them
        if key in CI_INTERPRET:
            seen.add(key)
        else:
            item.add_marker(pytest.mark.slow)
    whole = not config.option.keyword and all(os.path.isdir(str(a)) for a in config.args)
    stale = sorted(CI_INTERPRET - seen)
    if whole and stale:
        raise pytest.UsageError(f"tests/ci_budget.py lists interpret-mode runs that do not exist: {stale}")


@pytest.fixture
def interpret_barrier_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_linear runs in interpret mode the forms it refuses there by default (staged / ring scales with one row
    tile, swap_ab's staged scales: their barrier waits deadlock on a small CPU thread pool): the tests' pool has at
    least ``INTERPRET_POOL_THREADS`` threads (``pytest_configure``)."""
    from pallas_kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "INTERPRET_REFUSES_BARRIER_FORMS", False)
