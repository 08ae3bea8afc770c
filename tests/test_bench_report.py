"""BENCHMARKS.md is generated from the result files (``python -m jds.bench.report``): the committed page is what
the generator writes from the repository's results, it stays under 640 lines (one table per benchmark and card; a
new benchmark earns its lines), and every table names the one complete JSON file its numbers come from."""

from __future__ import annotations

import json
import os
import re

from jds.bench.report import collect, is_complete, render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def test_page_is_generated_from_the_results() -> None:
    text = render(RESULTS)
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        assert f.read() == text, "BENCHMARKS.md is stale: run python -m jds.bench.report"
    assert text.count("\n") < 640


def test_every_table_names_an_existing_complete_file() -> None:
    sections = re.split(r"\n## ", render(RESULTS))[1:]
    tabulated = [s for s in sections if "|---" in s]
    assert len(tabulated) >= 8
    for s in tabulated:
        title = s.splitlines()[0]
        (src,) = re.findall(r"\(source: `benchmarks/results/([^`]+)`\)$", s, re.M)
        path = os.path.join(RESULTS, src)
        assert os.path.isfile(path), (title, src)
        assert src.startswith(title + "_") and re.fullmatch(r".+_[a-z0-9]+_\d{4}-\d{2}-\d{2}\.json", src), src
        with open(path) as f:
            assert is_complete(src, json.load(f)), src


def test_table_numbers_come_from_the_source_file() -> None:
    """Each median in the boundary tables equals the source file's value for that step and mode."""
    current, _, _ = collect(RESULTS)
    name, d = current["boundary_v32"]
    section = render(RESULTS).split("## boundary_v32\n")[1].split("\n## ")[0]
    modes = d["archs"]["v32"]["modes"]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in modes["wide"] and isinstance(modes["wide"][cells[0]], dict):
            for mode, cell in zip(("wide", "narrow", "fused"), cells[1:4]):
                stat = modes[mode][cells[0]]
                assert cell == f"{stat.get('median_ms', stat.get('p50_ms')):.2f}", (cells[0], mode)


def test_completeness_and_current_file(tmp_path) -> None:
    """Newest complete file per benchmark; a ``complete: false`` or ``partial`` file is listed, not tabulated."""
    def put(name: str, meta: dict) -> None:
        (tmp_path / name).write_text(json.dumps({"meta": meta, "variants": {
            "fused:host": {"ttft_ms": 2.0, "prepare_ms": 0.5, "launch_ms": 1.0, "back_to_back_step_ms": 1.5,
                           "first_step_s": 3.0, "dispatches": {"captured": 1, "eager": 0}},
            "fused:device": {"ttft_ms": 1.0, "prepare_ms": 0.1, "launch_ms": 0.5, "back_to_back_step_ms": 1.4,
                             "first_step_s": 3.0, "dispatches": {"captured": 1, "eager": 0}}}}))

    put("ttft_h200_2026-11-28.json", {"date": "2026-11-28", "complete": True})
    put("ttft_h200_2026-11-30.json", {"date": "2026-11-30", "complete": False})
    put("ttft_partial_h200_2026-11-30.json", {"date": "2026-11-30"})
    current, rest, _ = collect(str(tmp_path))
    assert current["ttft"][0] == "ttft_h200_2026-11-28.json" and "ttft_partial" not in current
    assert rest == {"ttft_h200_2026-11-30.json": "incomplete", "ttft_partial_h200_2026-11-30.json": "incomplete"}
    text = render(str(tmp_path))
    # a file without per-dispatch parts has no first-dispatch columns
    assert "| fused:device | 1.00 | 0.10 | 0.50 | — | — | 1.40 | 3.0 | 1 + 0 | 0.50 |" in text


def test_one_current_file_per_card(tmp_path) -> None:
    """An H100 run does not supersede the H200's (the targets' card): each card's newest complete file gets its own
    table, the other card's titled ``<benchmark>_<device>``; within a card the newest file still wins."""
    from jds.bench.results import run_meta, write_json

    def put(name: str, us: float) -> None:
        rows = [{"case": "v4_decode_64", "variant": "default", "profile_span_us": us, "tflops": 1.0,
                 "max_abs_err": 0.001, "ref_max": 1.0}]
        write_json(str(tmp_path / name), {"meta": run_meta(variants={"default": {}}), "rows": rows})

    put("mqa_variants_h200_2026-12-04.json", 36.0)
    put("mqa_variants_h100_2026-12-04.json", 42.0)
    put("mqa_variants_h100_2026-12-05.json", 41.0)
    current, rest, _ = collect(str(tmp_path))
    assert {t: f for t, (f, _) in current.items()} == {"mqa_variants": "mqa_variants_h200_2026-12-04.json",
                                                       "mqa_variants_h100": "mqa_variants_h100_2026-12-05.json"}
    assert rest == {"mqa_variants_h100_2026-12-04.json": "superseded"}
    text = render(str(tmp_path))
    assert "## mqa_variants\n" in text and "## mqa_variants_h100\n" in text
    assert "| v4_decode_64 | default | 41.0 |" in text.split("## mqa_variants_h100")[1]


def test_script_result_file_renders(tmp_path) -> None:
    """A diag script's file (``run_meta`` + rows, as scripts/diag/mqa_variants.py writes it) is complete, named
    with its command, and tabulated with the default as the same-run reference; a failed row is listed."""
    from jds.bench.results import run_meta, write_json

    rows = [{"case": "v32_decode_64", "variant": "default", "profile_span_us": 100.0, "tflops": 365.0,
             "max_abs_err": 0.001, "ref_max": 1.0},
            {"case": "v32_decode_64", "variant": "splits2", "profile_span_us": 150.0, "tflops": 243.3,
             "max_abs_err": 0.002, "ref_max": 1.0},
            {"case": "v4_decode_64", "variant": "default", "error": "ValueError: no"}]
    write_json(str(tmp_path / "mqa_variants_h200_2026-12-02.json"),
               {"meta": run_meta(variants={"default": {}, "splits2": {"num_splits": 2}}), "rows": rows})
    current, rest, _ = collect(str(tmp_path))
    assert list(current) == ["mqa_variants"] and not rest
    text = render(str(tmp_path))
    assert "| v32_decode_64 | splits2 | 150.0 | 243 | 0.00200 | 1.50 |" in text
    assert "- v4_decode_64 default: ValueError: no" in text


def test_kernel_rows_show_the_timeline_where_measured() -> None:
    """Kernel rows with ``profile_span_us`` (the GPU timeline) get its columns and its fraction of the copy
    bandwidth; older files without it keep their columns."""
    from jds.bench.report import _kernel_rows

    meta = {"copy_bytes_per_s": 4e12, "bf16_flops_per_s": 8e14}
    row = {"kernel": "v4_qnorm_rope_kv_insert", "case": "T=8192", "median_us": 300.0, "device_unrolled_us": 290.0,
           "bandwidth_frac": 0.5, "flops_frac": None}
    old = _kernel_rows({"meta": meta, "rows": [{**row, "impl": "pallas"}, {**row, "impl": "xla"}]})
    assert "timeline" not in "\n".join(old)
    timed = {"profile_span_us": 250.0, "profile_bandwidth_frac": 0.7}
    new = _kernel_rows({"meta": meta, "rows": [{**row, **timed, "impl": "pallas"}, {**row, **timed, "impl": "xla"}]})
    header = next(line for line in new if line.startswith("| kernel"))
    assert "pallas timeline µs" in header and "pallas timeline of copy bw" in header
    assert "| 250.0 | 250.0 | 70.0% |" in "\n".join(new)


def test_profiled_device_us_threads_donated_buffers() -> None:
    """``thread``: the donated argument is replaced by the call's output, so calls after the first still run."""
    import jax.numpy as jnp

    from jds.bench.timing import profiled_device_us

    step = lambda cache, x: (cache.at[0].add(x), x + 1.0)  # noqa: E731
    assert profiled_device_us(step, jnp.zeros((8,)), jnp.ones(()), calls=3, warmup=2, thread=((0, 0),)) == {}
