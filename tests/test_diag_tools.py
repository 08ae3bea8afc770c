"""scripts/diag/ncu_sass_regions.py on a synthetic Nsight Compute source page, fp8_regions.py's phases on a synthetic
profiler trace (no GPU, no ncu)."""

from __future__ import annotations

import csv
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script(name: str):
    """scripts/diag/NAME.py as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"scripts/diag/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

regions_mod = _script("ncu_sass_regions")

HEADER = ["Address", "Source", regions_mod.SAMPLES, regions_mod.NOT_ISSUED, regions_mod.EXECUTED]


def _write(path: pathlib.Path) -> None:
    rows = [["Kernel Name", "loop_fusion"], HEADER, ["0x0", "NOP", "5", "5", "1"],
            ["Kernel Name", "kernel_mosaic_gpu_kernel"], HEADER,
            ["0x10", "LDC R1, c[0x0][0x28]", "2", "2", "4"],
            ["0x20", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0", "0", "0", "8"],
            ["0x30", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR22], R12", "1", "1", "16"],
            ["0x40", "@!P0  BRA 0x30", "30", "25", "16"],
            ["0x50", "@P0   EXIT", "0", "0", "8"],
            ["0x60", "USETMAXREG.DEALLOC.CTAPOOL 0x50", "0", "0", "4"],
            ["0x70", "F2FP.F16.E4M3.UNPACK_B R32, R28", "12", "10", "64"],
            ["0x80", "EXIT", "0", "0", "4"]]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_regions_and_opcodes(tmp_path):
    p = tmp_path / "k_sass.csv"
    _write(p)
    col, data = regions_mod.kernel_rows(str(p), "mosaic")
    assert len(data) == 8  # the first kernel's rows are not mixed in
    assert regions_mod.opcode("@!P0  BRA 0x30") == "BRA"
    assert regions_mod.opcode("F2FP.F16.E4M3.UNPACK_B R32, R28") == "F2FP"
    spans = regions_mod.regions(col, data)
    assert [(a, b) for a, b, _ in spans] == [(0, 1), (1, 4), (4, 5), (5, 7), (7, 8)]
    samples = [sum(int(r[col[regions_mod.SAMPLES]]) for r in data[a:b]) for a, b, _ in spans]
    assert samples == [2, 31, 0, 12, 0]


def test_missing_kernel(tmp_path):
    p = tmp_path / "k_sass.csv"
    _write(p)
    with pytest.raises(ValueError, match="no kernel"):
        regions_mod.kernel_rows(str(p), "triton")


def test_mqa_regions_summary():
    """scripts/diag/mqa_regions.py's reduction of a Mosaic GPU profiler trace: two CTAs of three warpgroups
    (traces 1-3, 4-6), nested regions, per-occurrence and per-CTA medians, CTA spans and spreads."""
    mod = _script("mqa_regions")

    def rng(name, tid, t0, t1):
        return [dict(name=name, ph="B", ts=t0, tid=tid), dict(name=name, ph="E", ts=t1, tid=tid)]

    ev = []
    for cta, off in ((0, 0.0), (1, 2.0)):
        wg0 = 1 + 3 * cta
        ev += rng("prologue", wg0, off, off + 3) + rng("qk", wg0, off + 3, off + 4) + rng("qk", wg0, off + 5, off + 7)
        ev += rng("epilogue", wg0, off + 7, off + 8) + rng("produce", wg0 + 2, off + 1, off + 6)
    s = mod.summarize(list(reversed(ev)), traces_per_cta=3)
    assert s["ctas"] == 2 and s["kernel_span_us"] == 10.0 and s["cta_span_median_us"] == 8.0
    assert s["cta_start_spread_us"] == 2.0 and s["cta_end_spread_us"] == 2.0
    assert s["regions"]["qk/wg0"] == {"median_us": 1.5, "per_cta_median_us": 3.0, "per_cta": 2.0}
    assert s["regions"]["produce/wg2"]["median_us"] == 5.0
    with pytest.raises(ValueError, match="unbalanced"):
        mod.summarize([dict(name="qk", ph="E", ts=1.0, tid=1)], traces_per_cta=3)


def test_fp8_region_phases():
    """First fill, step body, gap, tail and store per compute warpgroup (the producer's trace is left out), the
    median over CTAs; a trace whose events arrive out of order gives the same."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts/diag"))
    import fp8_regions

    def cta(tid: int, t0: float) -> list[dict]:
        spans = [("all", 0, 10), ("step", 2, 3), ("step", 3.5, 4.5), ("step", 5, 6), ("store", 6.5, 7.5)]
        return [dict(name=n, ph=ph, ts=t0 + t, tid=tid) for n, b, e in spans for ph, t in (("B", b), ("E", e))]

    events = [e for c in range(2) for w in range(3) for e in cta(3 * c + w + 1, 100.0 * c)]
    got = fp8_regions.phases(events[::-1])
    for wg in (0, 1):
        assert got[f"first_fill/wg{wg}"] == pytest.approx(2.0) and got[f"step/wg{wg}"] == pytest.approx(1.0)
        assert got[f"gap/wg{wg}"] == pytest.approx(0.5) and got[f"tail/wg{wg}"] == pytest.approx(4.0)
        assert got[f"store/wg{wg}"] == pytest.approx(1.0) and got[f"span/wg{wg}"] == pytest.approx(10.0)
    assert not any(k.endswith("wg2") for k in got)


def test_mosaic_sass_parsing():
    """scripts/diag/mosaic_sass.py's reading of a ``cuobjdump -sass`` listing: instructions with their line numbers
    (predicates skipped, encoding-only lines ignored), the histogram by base opcode, the stretches between two
    opcodes and a line range."""
    mod = _script("mosaic_sass")
    sass = "\n".join([
        "        Function : kernel_mosaic_gpu_kernel",
        "        /*0000*/                   LDS.128 R108, [R15+UR12+0x12480] ;   /* 0x0000000c0f6c7984 */",
        "                                                                        /* 0x000e280008000c00 */",
        "        /*0010*/                   LOP3.LUT R17, R17, 0x1c1c1c1c, RZ, 0xc0, !PT ;",
        "        /*0020*/              @!P0 BRA 0x30 ;",
        "        /*0030*/                   QGMMA.64x8x32.F32.E4M3.E4M3 R88, R72, gdesc[UR8], RZ, !UPT, gsb0 ;",
        "        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
        "        /*0050*/                   LOP3.LUT R18, R18, 0x80808080, R21, 0xf8, !PT ;"])
    ops = mod.opcodes(sass)
    assert [op for _, op in ops] == ["LDS.128", "LOP3.LUT", "BRA", "QGMMA.64x8x32.F32.E4M3.E4M3",
                                     "BAR.SYNC.DEFER_BLOCKING", "LOP3.LUT"]
    assert ops[0][0] == 2 and ops[1][0] == 4
    assert mod.histogram(ops) == {"LOP3": 2, "LDS": 1, "BRA": 1, "QGMMA": 1, "BAR": 1}
    assert [len(s) for s in mod.stretches(ops, "LDS.128", "BAR")] == [4]
    assert [op for _, op in mod.opcodes(sass, (4, 6))] == ["LOP3.LUT", "BRA", "QGMMA.64x8x32.F32.E4M3.E4M3"]


def test_triton_sass_loops():
    """scripts/diag/triton_sass.py's loop finder on a synthetic nvdisasm listing: a backward branch to an earlier
    label is a loop (its body from the label to the branch), a forward one is not; opcodes lose predicates and
    modifiers."""
    mod = _script("triton_sass")
    text = "\n".join([
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        ".L_x_0:",
        "        /*0010*/                   ISETP.GE.AND P0, PT, R2, RZ, PT ;",
        "        /*0020*/               @!P0 LOP3.LUT R3, R3, 0x7fffffff, RZ, 0x3c, !PT ;",
        "        /*0030*/               @P0 BRA `(.L_x_1) ;",
        "        /*0040*/                   IMAD.IADD R4, R4, 0x1, R3 ;",
        ".L_x_1:",
        "        /*0050*/               @P1 BRA `(.L_x_0) ;",
        "        /*0060*/                   EXIT ;"])
    n, found = mod.loops(text)
    assert n == 7
    assert [(lp["first"], lp["last"], lp["body"]) for lp in found] == [(1, 5, 5)]
    assert found[0]["opcodes"] == {"ISETP": 1, "LOP3": 1, "BRA": 2, "IMAD": 1}


def test_topk_passes_band_bucket():
    """topk_passes.py's first-pass bucket as a u range (``first_bucket(detail=True)``, the replay of ``_band_bucket``):
    short rows (two whose range crosses the sign, one whose pivot is positive), the band at 3 and 8 binades, margins
    0..2: the range holds exactly the bucket's keys, and counting from it reaches numpy's k-th key."""
    import numpy as np
    mod = _script("topk_passes")
    rng = np.random.default_rng(5)
    n, k = 16384, 2048
    crossed = []
    for length in (3000, 4500, 5000):
        x = np.full(n, -np.inf, np.float32)
        x[:length] = rng.standard_normal(length)
        u = mod.ordered(x)
        piv, hi = mod.pivot(u, k, n=length)
        crossed.append(piv < 1 << 31 <= hi)  # a negative pivot under a positive top: the band applies
        cand = u[u >= piv]
        want = int(np.partition(u, n - k)[n - k])
        for band in (3, 8):
            for m in (0, 1, 2):
                keys, lo, span, above = mod.first_bucket(cand, k, piv, hi, m, band, detail=True)
                assert keys == mod.first_bucket(cand, k, piv, hi, m, band)
                c = cand.astype(np.int64)
                bc = cand[(c >= lo) & (c - lo <= span)]
                assert bc.size == keys and int((c > lo + span).sum()) == above, (length, band, m)
                for exit_one in (False, True):  # ... and with the exit at one key (TopkSelectConfig.exit_at_one)
                    assert mod.passes(bc, k - above, lo, span, max(span.bit_length() - 4, 0), exit_one=exit_one)[2] \
                        == want
    assert crossed[:2] == [True, True], crossed


def test_topk_passes_replay():
    """scripts/diag/topk_passes.py's replay of the top-k finish's range arithmetic (``_kth_key``): the k-th key equals
    numpy's, from the whole key space (8 passes of 4-bit digits) and from the pivot, on rows whose k-th key lies
    far past the sample's largest (the clamped top digit, then wider digits)."""
    import numpy as np
    mod = _script("topk_passes")
    rng = np.random.default_rng(3)
    n, k = 8192, 256
    for far in (0.0, 100.0, 1e30):
        x = rng.standard_normal(n)
        x[rng.choice(np.setdiff1d(np.arange(n), (np.arange(1024) * n) // 1024), 300, replace=False)] += far
        u = mod.ordered(x)
        piv, hi = mod.pivot(u, k)
        cand = u[u >= piv]
        want = int(np.partition(u, n - k)[n - k])
        full, total, tau = mod.passes(cand, k, 0, 0xFFFFFFFF, 28)
        assert tau == want and total == 8
        full, total, tau = mod.passes(cand, k, *mod.pivot_start(piv, hi, 1))
        assert tau == want and 1 <= full <= total


def test_step_kernels_sources(tmp_path):
    """step_kernels.py names each kernel by its instruction's innermost jds frames (an HLO dump's source tables,
    parent ids one more than the row id, runner.py and library frames left out) and sums kernels by them."""
    sk = _script("step_kernels")
    (tmp_path / "module_0001.jit_full.sm_9.0_gpu_after_optimizations.txt").write_text("\n".join([
        "HloModule jit_full",
        "  %loop_convert_fusion.2 = bf16[4]{0} fusion(%p), kind=kLoop, calls=%c, "
        'metadata={op_name="jit(full)/slice" stack_frame_id=3}',
        "  ROOT %gemm_fusion_dot-1 = f32[4]{0} fusion(%q), kind=kCustom, calls=%d, "
        'metadata={op_name="jit(full)/dot_general" stack_frame_id=4}',
        "", "FileNames", '1 "/work/main/jds/runner.py"', '2 "/work/main/jds/v32.py"', '3 "/usr/lib/jax/core.py"',
        "", "FunctionNames", '1 "BoundaryRunner.step"', '2 "V32Attention._wkv_b_heads"', '3 "V32Attention.prepare"',
        '4 "bind"',
        "", "FileLocations", "1 {file_name_id=1 function_name_id=1 line=741}",
        "2 {file_name_id=2 function_name_id=3 line=131}", "3 {file_name_id=2 function_name_id=2 line=163}",
        "4 {file_name_id=3 function_name_id=4 line=9}",
        "", "StackFrames", "1 {file_location_id=1 parent_frame_id=0}", "2 {file_location_id=2 parent_frame_id=2}",
        "3 {file_location_id=3 parent_frame_id=3}", "4 {file_location_id=4 parent_frame_id=4}", ""]))
    src = sk.hlo_sources(str(tmp_path))
    assert src["loop_convert_fusion_2"] == {"op_name": "jit(full)/slice",
                                            "source": "v32.py:163(_wkv_b_heads) < v32.py:131(prepare)"}
    assert src["gemm_fusion_dot_1"]["source"] == "v32.py:163(_wkv_b_heads) < v32.py:131(prepare)"
    rows = sk.by_source({"loop_convert_fusion_2": 3.0, "gemm_fusion_dot_1": 2.0, "nvjet_sm90_gemm": 4.0}, src)
    assert rows[0]["us"] == 5.0 and rows[0]["kernels"] == 2 and rows[0]["ops"] == ["dot_general", "slice"]
    assert rows[1] == {"source": "nvjet_sm90_gemm", "us": 4.0, "kernels": 1, "ops": []}


def test_step_kernels_diff(tmp_path, capsys):
    """--diff: two runs compared per shape by source function, line numbers left out (they move between the
    trees an A/B compares), the largest changes first; shapes only one run has are left out."""
    sk = _script("step_kernels")

    def run(rows, busy):
        return {"shapes": {"ttft_128": {"profile_busy_us": busy, "by_source": rows}, "only": {"error": "x"}}}

    base = run([{"source": "v32.py:180(_absorb_uk) < v32.py:131(prepare) < model.py:145(__call__)", "us": 98.0},
                {"source": "v32.py:194(_per_head) < v32.py:200(_absorb_uk) < v32.py:137(prepare)", "us": 117.0},
                {"source": "fp8_gemm_mosaic_gpu_kernel", "us": 2000.0}], 3300.0)
    new = run([{"source": "v32.py:201(_per_head) < v32.py:203(_absorb_uk) < v32.py:139(prepare)", "us": 118.0},
               {"source": "fp8_gemm_mosaic_gpu_kernel", "us": 1990.0}], 3200.0)
    d = sk.diff_runs(base, new, top=2)
    assert list(d) == ["ttft_128"] and d["ttft_128"]["busy_us"] == (3300.0, 3200.0)
    assert d["ttft_128"]["changes"] == [("v32.py(_absorb_uk) < v32.py(prepare)", 98.0, 0.0),
                                        ("fp8_gemm_mosaic_gpu_kernel", 2000.0, 1990.0)]
    for name, r in (("base.json", base), ("new.json", new)):
        (tmp_path / name).write_text(json.dumps(r))
    sk.main(["--diff", str(tmp_path / "base.json"), str(tmp_path / "new.json"), "--top", "3"])
    out = capsys.readouterr().out
    assert "== ttft_128: busy 3300.0 -> 3200.0 us (-100.0)" in out
    assert "117.0 ->     118.0 (    +1.0)  v32.py(_per_head) < v32.py(_absorb_uk)" in out


def test_hlo_fusions(tmp_path):
    """hlo_fusions.py: a kernel named as on the timeline (``loop_slice_fusion_2``) found as its instruction
    (``loop_slice_fusion.2``), with its users and its fused computation; step_kernels.py's ``--fusions`` text."""
    hf, sk = _script("hlo_fusions"), _script("step_kernels")
    (tmp_path / "module_0001.jit_full.sm_9.0_gpu_after_optimizations.txt").write_text("\n".join([
        "HloModule jit_full", "",
        "%fused_slice (param_0: f32[4,8]) -> f32[4,2] {",
        "  %param_0 = f32[4,8]{1,0} parameter(0)",
        "  ROOT %slice.1 = f32[4,2]{1,0} slice(%param_0), slice={[0:4], [0:2]}",
        "}", "",
        "ENTRY %main (p: f32[4,8]) -> f32[4,2] {",
        "  %p = f32[4,8]{1,0} parameter(0)",
        '  %loop_slice_fusion.2 = f32[4,2]{1,0} fusion(%p), kind=kLoop, calls=%fused_slice, '
        'metadata={op_name="jit(full)/slice"}',
        "  ROOT %custom-call.3 = f32[4,2]{1,0} custom-call(%loop_slice_fusion.2), custom_call_target=\"k\"",
        "}", ""]))
    out = hf.describe_dump(str(tmp_path), ["loop_slice_fusion_2"])
    assert out[0] == "# module_0001.jit_full.sm_9.0_gpu_after_optimizations.txt"
    assert out[1].startswith("== loop_slice_fusion.2: %loop_slice_fusion.2 = f32[4,2]")
    assert out[2].startswith("  used by: ROOT %custom-call.3")
    assert any("slice(%param_0)" in line for line in out[3:])
    assert hf.describe_dump(str(tmp_path), ["loop_slice_fusion_9"]) == []
    src = {"loop_slice_fusion_2": {"source": "v4.py:193(project_in)"}}
    assert sk._fusions(str(tmp_path), {"loop_slice_fusion_2": 3.0}, src, "v4.py", 5) == out
    assert sk._fusions(str(tmp_path), {"loop_slice_fusion_2": 3.0}, src, None, 5) == []
