"""The host-path benchmarks' own logic: the VLOG parser of ``jds.bench.graph_updates`` on XLA's log lines,
and ``jds.bench.engine_steps`` end to end on a tiny model (CPU)."""

from __future__ import annotations

import json

from jds.bench.graph_updates import MARK, parse_log

LOG = f"""I1201 02:38:04.40 431 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=6
{MARK} fused:device|serial_drop
I1201 02:38:04.41 431 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=7
I1201 02:38:04.42 431 command_buffer_thunk.cc:330] Update command buffer on device #0 by recoding command buffer cmd sequence after 1 executions since last update; num_commands=84; updated_allocs=2
I1201 02:38:04.43 431 command_buffer_thunk.cc:350] Updated command buffer in 412 μs; num_commands=84
I1201 02:38:04.44 431 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=1
{MARK} fused:device|in_flight_2
I1201 02:38:04.45 431 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=2
{MARK} end
I1201 02:38:04.46 431 command_buffer_thunk.cc:330] Update command buffer on device #0 ... updated_allocs=5
"""


def test_parse_log_counts_per_phase() -> None:
    ph = parse_log(LOG)
    assert set(ph) == {"fused:device|serial_drop", "fused:device|in_flight_2"}
    drop = ph["fused:device|serial_drop"]
    assert (drop["executions"], drop["updates"], drop["updated_allocs"], drop["update_us"]) == (2, 1, [2], 412)
    flight = ph["fused:device|in_flight_2"]
    assert (flight["executions"], flight["updates"]) == (1, 0)  # the line after "end" belongs to no phase


def test_engine_steps_runs_both_loops(tmp_path) -> None:
    from jds.bench.engine_steps import main

    out = tmp_path / "es.json"
    # one bucket and a small pool (the bench's defaults size an H200's: 600 pages, 64 rows): CI budget
    main(["--preset", "v32-tiny", "--requests", "1", "--output-len", "4", "--num-blocks", "16", "--max-num-seqs",
          "4", "--max-model-len", "256", "--key-block-buckets", "16", "--max-num-tokens", "128", "--token-buckets",
          "128", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["meta"]["complete"]
    for name in ("async", "sync"):
        e = res["engines"][name]
        assert e["decode_steps"] >= 3 and e["ms_per_step_median"] > 0
        assert 0 <= e["submit_or_execute_ms_median"] <= e["ms_per_step_median"] * 1.5
