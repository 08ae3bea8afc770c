"""The sparse MQA producer's register dequantisation (pallas_kernels/record_gather.py) against
``MlaRecord656.unpack``, bit for bit.

- CPU: the power-of-two path's arithmetic (``_DQ_POW2_ASM``: bit placement, two bf16 products), modelled in
  numpy, over every e4m3 byte and the whole range of UE8M0 scales the cache writer produces; the kernels lower
  for CUDA; bad shapes are refused.
- ``gpu``: ``dequant_blocks`` on real records, the fp32 path for both scale formats and the power-of-two path
  for UE8M0 records (its subnormal inputs included), every element equal to XLA's dequantisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jds.ops.records import MlaRecord656
from pallas_kernels import record_gather

from tests.kernel_modes import ON_GPU


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), as float32."""
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _bits_to_f32(bits16: np.ndarray) -> np.ndarray:
    return (bits16.astype(np.uint32) << 16).view(np.float32)


def test_pow2_arithmetic_model():
    """Every e4m3 byte (NaN aside) times every power-of-two scale of the cache writer's range: the placed bit
    pattern is the byte's value times 2^-120 (subnormals included), and both bf16 products are exact, so the
    result equals round_bf16(value * scale) as the fp32 path computes it."""
    b = np.arange(256, dtype=np.uint32)
    b = b[(b & 0x7F) != 0x7F]  # e4m3fn NaN
    value = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    placed = _placed(b)  # the PTX's prmt / shl / and, per 16-bit half (test_place_permutes)
    x = _bits_to_f32(placed)
    assert np.array_equal(x, value * np.float32(2.0 ** -120))  # exact (numpy keeps float32 subnormals)
    for k in range(-24, 40):  # UE8M0 scales: >= 1e-4 / 448 > 2^-22
        scale = np.float32(2.0 ** k)
        sbits = np.array([scale]).view(np.uint32)[0]
        s1 = _bits_to_f32(np.uint32((sbits + record_gather._SCALE_2P60) >> 16))
        assert s1 == np.float32(2.0 ** (k + 60))
        got = _bf16_round(_bf16_round(x * s1) * np.float32(2.0 ** 60))
        want = _bf16_round(value * scale)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), k
    assert _bits_to_f32(np.uint32(record_gather._BF16X2_2P60 & 0xFFFF)) == np.float32(2.0 ** 60)


def test_pow2_shifted_model():
    """``k_shift``: one bf16 product by scale * 2^60 leaves every e4m3 byte's value times scale * 2^-60, exactly
    (a normal bf16) over the cache writer's scales; the rope values' factor is 2^-60 in both halves."""
    b = np.arange(256, dtype=np.uint32)
    b = b[(b & 0x7F) != 0x7F]
    value = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    x = _bits_to_f32(_placed(b))
    for k in range(-24, 40):
        sbits = np.array([np.float32(2.0 ** k)]).view(np.uint32)[0]
        s1 = _bits_to_f32(np.uint32((sbits + record_gather._SCALE_2P60) >> 16))
        got = _bf16_round(x * s1)
        want = value * 2.0 ** (k - record_gather.K_SHIFT)
        assert np.array_equal(got.astype(np.float64), want), k
        nz = want != 0
        assert np.all(np.abs(want[nz]) >= 2.0 ** -126)  # normal: no flush anywhere downstream
    m60 = _bits_to_f32(np.uint32(record_gather._BF16X2_2M60 & 0xFFFF))
    assert m60 == np.float32(2.0 ** -60) and record_gather._BF16X2_2M60 >> 16 == record_gather._BF16X2_2M60 & 0xFFFF
    for swap in (False, True):  # one product per word instead of two
        assert record_gather._DQ_POW2_SHIFTED[swap].count("mul.rn.bf16x2") == 8
    assert record_gather._DQ_POW2_ASM.count("mul.rn.bf16x2") == 16


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` in its default mode: result byte i is byte (sel >> 4 i) & 7 of b:a, or that byte's sign
    replicated over 8 bits where the selector nibble's bit 3 is set."""
    src = a | b << 32
    out = 0
    for i in range(4):
        nib = (sel >> 4 * i) & 0xF
        byte = (src >> 8 * (nib & 7)) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << 8 * i
    return out


def _prmt_np(a: np.ndarray, sel: int) -> np.ndarray:
    """``_prmt(a, 0, sel)`` over an array of words (uint64 holding 32-bit values)."""
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> 4 * i) & 0xF
        byte = (a >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF) if (nib & 7) < 4 else np.zeros_like(a)
        if nib & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * i)
    return out


def _placed(b: int) -> int:
    """The bf16 bit pattern of e4m3 byte ``b`` times 2^-120 (``test_pow2_arithmetic_model``)."""
    return ((b & 0x80) << 8) | ((b & 0x7F) << 4)


def test_place_permutes():
    """The power-of-two dequantisation's placement, as its PTX does it (a sign-replicating byte permute, a shift by
    4, one mask), against the formula the arithmetic model checks, for every pair of e4m3 bytes in each position;
    the swapped selectors read the other word's bytes (lanes that exchange a chunk's halves) and place them the
    same way."""
    b = np.arange(256, dtype=np.uint64)
    hi, lo = np.repeat(b, 256), np.tile(b, 256)
    pair = hi << np.uint64(8) | lo
    want = _placed(hi) << np.uint64(16) | _placed(lo)
    mask = np.uint64(record_gather._PLACE_MASK)
    for k, sel in enumerate(record_gather._PLACE_SEL):  # bytes 2k, 2k + 1 of the word; the other pair: any bytes
        for other in (0x0000, 0x5A3C, 0xFFFF):
            word = pair << np.uint64(16 * k) | np.uint64(other << 16 * (1 - k))
            np.testing.assert_array_equal((_prmt_np(word, sel) << np.uint64(4)) & mask, want)
        assert _prmt_np(np.array([0x12345678], np.uint64), sel)[0] == _prmt(0x12345678, 0, sel)
    rng = np.random.default_rng(0)
    for _ in range(200):
        own, other = (int(x) for x in rng.integers(0, 2 ** 32, 2, dtype=np.uint64))
        for sels, plain in ((record_gather._SEL_EVEN, record_gather._PLACE_SEL[0]),
                            (record_gather._SEL_ODD, record_gather._PLACE_SEL[1])):
            assert _prmt(own, other, sels[0]) == _prmt(own, 0, plain)
            assert _prmt(own, other, sels[1]) == _prmt(other, 0, plain)
    asm = record_gather._DQ_POW2_ASM
    assert asm.count("prmt.b32") == 8 and asm.count("shl.b32") == 8 and asm.count("and.b32") == 8


def test_swap_selectors():
    """The fp32 path's pre-permute: lanes that keep their halves read input word j, the others word (j + 2) % 4."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        own, other = (int(x) for x in rng.integers(0, 2 ** 32, 2, dtype=np.uint64))
        assert _prmt(own, other, 0x3210) == own and _prmt(own, other, 0x7654) == other
    assert "$14" in record_gather._DQ_POW2_SWAP_ASM and "$13" in record_gather._DQ_SWAP_ASM


def test_scale_permutes():
    """The scales' byte permutes against the shifts and masks they replace: byte k of a UE8M0 exponent word ->
    bf16x2 of (e + 60) << 7 in both halves; a power-of-two fp32 scale's bits + 2^60's exponent -> their high
    half in both halves."""
    rng = np.random.default_rng(1)
    for word in [int(x) for x in rng.integers(0, 2 ** 32, 200, dtype=np.uint64)] + [0, 0xFFFFFFFF]:
        for k in range(4):
            hb = (((word >> 8 * k) & 0xFF) + 60) << 7
            got = ((_prmt(word, 0, record_gather.ue8m0_selector(k)) >> 1) + record_gather._UE8M0_2P60) & 0xFFFFFFFF
            assert got == hb | hb << 16, (hex(word), k)
        t = (word + record_gather._SCALE_2P60) & 0xFFFFFFFF
        assert _prmt(t, 0, 0x3232) == (t >> 16) | (t >> 16) << 16


@pytest.mark.skipif(ON_GPU, reason="the native test compiles the kernel")
@pytest.mark.parametrize("pow2", [False, True])
def test_lowers_for_cuda(pow2):
    f = jax.jit(lambda c, s: record_gather.dequant_blocks(c, s, pow2_scales=pow2))
    exp = jax.export.export(f, platforms=["cuda"])(jax.ShapeDtypeStruct((4096, 656), jnp.uint8),
                                                  jax.ShapeDtypeStruct((8, 64), jnp.int32))
    assert "mosaic_gpu" in exp.mlir_module()


@pytest.mark.skipif(ON_GPU, reason="the native test compiles the kernel")
def test_extents_lower_for_cuda():
    f = jax.jit(lambda a, b, c: record_gather.kernel_extents([a, b, c]))
    exp = jax.export.export(f, platforms=["cuda"])(*(jax.ShapeDtypeStruct((8, k), jnp.int32) for k in (64, 128, 576)))
    assert "mosaic_gpu" in exp.mlir_module()


def test_extents_bad_inputs():
    with pytest.raises(ValueError, match="lists must be"):
        record_gather.kernel_extents([jnp.zeros((2, 64), jnp.int32), jnp.zeros((3, 64), jnp.int32)])
    with pytest.raises(ValueError, match="widths"):
        record_gather.kernel_extents([jnp.zeros((2, 100), jnp.int32)])


@pytest.mark.gpu
def test_extents_exact():
    """The in-kernel live blocks (``list_extents``) equal the wrapper's (``sparse_mqa._extents``) for every
    token: lists of 1, 2, 8 and 9 blocks (a last chunk of 64 slots), random dead tails, dead blocks inside,
    fully masked rows and a row whose only live slot is its list's last."""
    if not ON_GPU:
        pytest.skip("native only")
    from pallas_kernels import sparse_mqa as mqa
    rng = np.random.default_rng(5)
    t, lists = 64, []
    for nb in (1, 2, 8, 9):
        s = rng.integers(0, 1 << 20, (t, nb * 64)).astype(np.int32)
        for r in range(t):
            s[r, rng.integers(0, nb + 1) * 64:] = -1
            s[r, rng.integers(0, nb) * 64:][:64] = -1
        s[rng.random(s.shape) < 0.5] = -1
        s[3] = -1
        s[4, :-1], s[4, -1] = -1, 7
        lists.append(jnp.asarray(s))
    got = record_gather.kernel_extents(lists)
    want = mqa._extents(lists)
    for g, w in zip(got, want):
        assert np.asarray(g).dtype == np.int32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bad_shapes():
    with pytest.raises(ValueError, match="slots must be"):
        record_gather.dequant_blocks(jnp.zeros((16, 656), jnp.uint8), jnp.zeros((2, 32), jnp.int32))
    with pytest.raises(ValueError, match="cache uint8"):
        record_gather.dequant_blocks(jnp.zeros((16, 576), jnp.uint8), jnp.zeros((2, 64), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("scale_fmt,pow2", [("ue8m0", False), ("ue8m0", True), ("amax", False)])
def test_dequant_bit_exact(scale_fmt, pow2):
    """Rows of widely spread magnitudes (so blocks hold e4m3 subnormals and zeros), 64 blocks of random slots."""
    if not ON_GPU:
        pytest.skip("native only")
    rng = np.random.default_rng(3)
    n = 8192
    rows = rng.standard_normal((n, 576)).astype(np.float32) * np.exp(3.0 * rng.standard_normal((n, 1)))
    rows *= np.exp(2.0 * rng.standard_normal((1, 576))).astype(np.float32)  # columns far below their block's max
    fmt = MlaRecord656(entries_per_page=1, scale_fmt=scale_fmt)
    cache = jax.jit(fmt.pack)(jnp.asarray(rows))
    slots = jnp.asarray(rng.integers(0, n, (64, 64), dtype=np.int32))
    got = np.asarray(record_gather.dequant_blocks(cache, slots, pow2_scales=pow2))
    want = np.asarray(fmt.unpack(jnp.take(cache, slots.reshape(-1), axis=0)).astype(jnp.bfloat16))
    bad = got.view(np.uint16) != want.view(np.uint16)
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} elements differ"


def _k_tile_slot(row: int, col: int, cols: int = record_gather.K_COLS) -> tuple[int, int]:
    """(byte address, 16-byte bank slot) of K-tile element (row, col) under ``K_TILE_TRANSFORMS``: (8, 32) tiles
    of 512 bytes, row-tile major, 16-byte unit u of row r at u ^ ((r >> 1) & 3) (``_Emit.k_row`` / ``k_addr``)."""
    r8 = row % 8
    addr = (row // 8) * (cols // 32) * 512 + r8 * 64 + (col >> 5) * 512 + ((((col >> 3) & 3) ^ ((r8 >> 1) & 3)) * 16)
    return addr, (addr % 128) // 16


@pytest.mark.parametrize("fmt", ["v32", "v4"])
def test_coalesced_producer_lane_map(fmt):
    """``produce_tile``'s lane roles (``coalesced_lane``) for V3.2's and V4's records: the four warps
    write every 8-column unit of the block's 64 rows exactly once (NoPE chunk c holds columns 16 c .. 16 c + 15
    and takes the scale of group c // 8 (V3.2) or c // 4 (V4); V4's lanes past its 28 chunks store nothing); each
    load instruction of a warp reads 16 contiguous chunks of two rows (latent) or the 8
    rope chunks of four rows; and every quarter-warp of every shared store hits eight distinct 16-byte bank
    slots (no conflict)."""
    f = record_gather._C656 if fmt == "v32" else record_gather._C584
    written: set[tuple[int, int]] = set()
    stores: dict[tuple, list[int]] = {}  # store instruction -> the bank slot of each lane
    for warp in range(4):
        for lane in range(32):
            m = record_gather.coalesced_lane(lane)
            for p in range(8):
                row = 16 * warp + 2 * p + m["h"]
                for j in range(2):
                    chunk = 16 * j + m["c"]
                    if chunk >= f.nope_chunks:  # predicated off
                        continue
                    if fmt == "v32":  # the scale word of the chunk's 128-column group: + 8 j from group_lo's
                        assert m["group_lo"] + 2 * j == chunk // 8
                    else:  # the exponent byte of its 64-column group: word j, byte c // 4
                        assert 4 * j + m["c"] // 4 == chunk // 4
                    first = 16 * chunk + 8 * m["swap"]
                    for n, col in enumerate((first, first ^ 8)):  # the two stores, in the lane's order
                        assert (row, col) not in written
                        written.add((row, col))
                        stores.setdefault((warp, "lat", p, j, n), []).append(_k_tile_slot(row, col, f.cols)[1])
            for q in range(4):
                row = 16 * warp + 4 * q + m["rope_row"]
                col = f.rope_col + 8 * m["rc"]
                assert (row, col) not in written
                written.add((row, col))
                stores.setdefault((warp, "rope", q), []).append(_k_tile_slot(row, col, f.cols)[1])
    assert sorted(written) == [(r, c) for r in range(64) for c in range(0, f.cols, 8)]
    for key, slots in stores.items():  # V4's second NoPE stores: lanes 0..23 (quarter-warps 0..2)
        for qw in range(len(slots) // 8):
            assert len(set(slots[8 * qw:8 * qw + 8])) == 8, (key, qw, slots)
    roles = [record_gather.coalesced_lane(x) for x in range(32)]
    assert {(m["h"], m["c"]) for m in roles} == {(h, c) for h in range(2) for c in range(16)}
    assert {(m["rope_row"], m["rc"]) for m in roles} == {(r, c) for r in range(4) for c in range(8)}
