"""The thunk-dump reader: graphs vs direct launches, and eager modules that have no after-passes file."""

from __future__ import annotations

from jds.bench.thunks import read_dump


def test_read_dump_takes_each_modules_final_sequence(tmp_path) -> None:
    # A captured module: its pre-pass sequence (three kernels) and the final one (one command buffer).
    (tmp_path / "module_1.jit_first.thunk_sequence.txt").write_text("kKernel a\nkKernel b\nkGemm c\n")
    (tmp_path / "module_1.jit_first.thunk_sequence_after_thunk_passes.txt").write_text(
        "kCommandBuffer\n  kKernel a\n  kKernel b\n  kGemm c\n")
    # An eager module (command buffers off): XLA wrote only the plain sequence (seen on the H200).
    (tmp_path / "module_2.jit_consume.thunk_sequence.txt").write_text("kKernel x\nkGemm y\nkCustomCall z\n")
    mods = read_dump(str(tmp_path))
    assert set(mods) == {"module_1.jit_first", "module_2.jit_consume"}
    first, eager = mods["module_1.jit_first"], mods["module_2.jit_consume"]
    assert (first.command_buffers, first.direct_launches, len(first.in_graphs)) == (1, 1, 3)
    assert (eager.command_buffers, eager.direct_launches, len(eager.in_graphs)) == (0, 3, 0)
