"""The concrete cache record formats (see docs/DESIGN.md): float rows, V3.2's 656-byte fp8_ds_mla,
the 132-byte indexer record, and V4's 584-byte fp8_ds_mla. Kernels in pallas_kernels/ write the
same bytes; these pack/unpack functions are their reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jds.ops.quant import FLT_MIN, FP8, FP8_MAX, act_quant, block_scale, dequant, fp4_quant, quantize_e4m3, true_divide


def _bytes(x: jax.Array) -> jax.Array:
    """Bitcast to uint8 with a trailing byte axis merged into the last axis."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    if b.ndim > x.ndim:
        b = b.reshape(x.shape[:-1] + (x.shape[-1] * b.shape[-1],))
    return b


def _from_bytes(b: jax.Array, dtype: jnp.dtype) -> jax.Array:
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(b.shape[:-1] + (b.shape[-1] // size, size)), dtype)


def offsets_from_segments(segs: tuple[tuple[jax.Array, int], ...]) -> jax.Array:
    """Element offsets [..., record] of a record made of contiguous (start, length) segments."""
    return jnp.concatenate([st[..., None] + jnp.arange(n, dtype=jnp.int32) for st, n in segs], axis=-1)


@dataclass(frozen=True)
class FloatRows:
    """Plain rows of ``dim`` elements in ``dtype`` (bf16/f32 caches, compressor state)."""

    dim: int
    entries_per_page: int
    dtype: jnp.dtype = jnp.float32

    @property
    def page_elems(self) -> int:
        return self.entries_per_page * self.dim

    def segments(self, slots: jax.Array) -> tuple[tuple[jax.Array, int], ...]:
        return ((slots * self.dim, self.dim),)

    def offsets(self, slots: jax.Array) -> jax.Array:
        return offsets_from_segments(self.segments(slots))

    def pack(self, rows: jax.Array) -> jax.Array:
        return rows.astype(self.dtype)

    def unpack(self, recs: jax.Array) -> jax.Array:
        return recs.astype(jnp.float32)


@dataclass(frozen=True)
class MlaRecord656:
    """V3.2 ``fp8_ds_mla``: [512 e4m3 latent | 4 fp32 scales | 64 bf16 rope] per token, contiguous.

    scale_fmt "ue8m0" (DeepSeek [R-fix], floor 1e-4) or "amax" (vLLM: amax/448, floor FLT_MIN).
    """

    entries_per_page: int
    scale_fmt: str = "ue8m0"
    latent_dim: int = 512
    rope_dim: int = 64
    dtype: jnp.dtype = jnp.uint8

    @property
    def record_bytes(self) -> int:
        return self.latent_dim + 4 * (self.latent_dim // 128) + 2 * self.rope_dim

    @property
    def page_elems(self) -> int:
        return self.entries_per_page * self.record_bytes

    def segments(self, slots: jax.Array) -> tuple[tuple[jax.Array, int], ...]:
        return ((slots * self.record_bytes, self.record_bytes),)

    def offsets(self, slots: jax.Array) -> jax.Array:
        return offsets_from_segments(self.segments(slots))

    def pack(self, rows: jax.Array) -> jax.Array:
        lat, pe = rows[..., : self.latent_dim], rows[..., self.latent_dim:]
        if self.scale_fmt == "ue8m0":
            q, s = act_quant(lat, 128, "ue8m0", 1e-4)
        else:  # vLLM's writer: scale = max(amax / 448, FLT_MIN) (a true division), then x / scale saturated
            lb = lat.astype(jnp.float32).reshape(lat.shape[:-1] + (self.latent_dim // 128, 128))
            s = jnp.maximum(true_divide(jnp.max(jnp.abs(lb), axis=-1), FP8_MAX), FLT_MIN)
            q = quantize_e4m3(true_divide(lb, s[..., None])).reshape(lat.shape)
        return jnp.concatenate([_bytes(q), _bytes(s), _bytes(pe.astype(jnp.bfloat16))], axis=-1)

    def unpack(self, recs: jax.Array) -> jax.Array:
        n_s = self.latent_dim // 128
        q = _from_bytes(recs[..., : self.latent_dim], FP8).astype(jnp.float32)
        s = _from_bytes(recs[..., self.latent_dim: self.latent_dim + 4 * n_s], jnp.float32)
        pe = _from_bytes(recs[..., self.latent_dim + 4 * n_s:], jnp.bfloat16).astype(jnp.float32)
        lat = (q.reshape(q.shape[:-1] + (n_s, 128)) * s[..., None]).reshape(q.shape)
        return jnp.concatenate([lat, pe], axis=-1)


@dataclass(frozen=True)
class IndexerRecord132:
    """Indexer key: 128 e4m3 values + 1 fp32 scale; page = [bs x 128 values][bs x 4-byte scales].

    ``scale_fmt``: "ue8m0" (power-of-two scale) or "amax" (amax/448), both with DeepSeek's 1e-4 amax floor;
    the checkpoint's activation scale format (``Numerics.act_scale_fmt``). The fp32 scale field stores either.
    """

    entries_per_page: int
    dim: int = 128
    dtype: jnp.dtype = jnp.uint8
    scale_fmt: str = "ue8m0"

    @property
    def page_elems(self) -> int:
        return self.entries_per_page * (self.dim + 4)

    def segments(self, slots: jax.Array) -> tuple[tuple[jax.Array, int], ...]:
        page, j = slots // self.entries_per_page, slots % self.entries_per_page
        base = page * self.page_elems
        return ((base + j * self.dim, self.dim), (base + self.entries_per_page * self.dim + j * 4, 4))

    def offsets(self, slots: jax.Array) -> jax.Array:
        return offsets_from_segments(self.segments(slots))

    def pack(self, rows: jax.Array) -> jax.Array:
        q, s = act_quant(rows, self.dim, self.scale_fmt, 1e-4)
        return jnp.concatenate([_bytes(q), _bytes(s)], axis=-1)

    def unpack(self, recs: jax.Array) -> jax.Array:
        q = _from_bytes(recs[..., : self.dim], FP8).astype(jnp.float32)
        s = _from_bytes(recs[..., self.dim:], jnp.float32)
        return q * s


@dataclass(frozen=True)
class IndexerRecordFP4:
    """Indexer key as MXFP4 (V4's released indexer): ``dim`` e2m1 values packed two per byte (element 2i in the
    low nibble) + one e8m0 scale byte (exponent + 127) per 32 values; 64 + 4 = 68 bytes per 128-d key. Page =
    [epp x dim/2 value bytes][epp x dim/32 scale bytes], split like ``IndexerRecord132``'s."""

    entries_per_page: int
    dim: int = 128
    block: int = 32
    dtype: jnp.dtype = jnp.uint8

    @property
    def record_bytes(self) -> int:
        return self.dim // 2 + self.dim // self.block

    @property
    def page_elems(self) -> int:
        return self.entries_per_page * self.record_bytes

    def segments(self, slots: jax.Array) -> tuple[tuple[jax.Array, int], ...]:
        page, j = slots // self.entries_per_page, slots % self.entries_per_page
        base, vb, sb = page * self.page_elems, self.dim // 2, self.dim // self.block
        return ((base + j * vb, vb), (base + self.entries_per_page * vb + j * sb, sb))

    def offsets(self, slots: jax.Array) -> jax.Array:
        return offsets_from_segments(self.segments(slots))

    def pack(self, rows: jax.Array) -> jax.Array:
        q, s = fp4_quant(rows, self.block)
        codes = jax.lax.bitcast_convert_type(q.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
        codes = codes.reshape(codes.shape[:-1] + (self.dim // 2, 2))
        packed = codes[..., 0] | (codes[..., 1] << 4)
        exps = (jnp.frexp(s)[1] - 1 + 127).astype(jnp.uint8)  # s = 2^(e - 1) exactly
        return jnp.concatenate([packed, exps], axis=-1)

    def unpack(self, recs: jax.Array) -> jax.Array:
        vb = self.dim // 2
        b = recs[..., :vb].astype(jnp.uint8)
        codes = jnp.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[:-1] + (self.dim,))
        q = jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(jnp.float32)
        s = jnp.ldexp(jnp.ones(recs.shape[:-1] + (self.dim // self.block,), jnp.float32),
                      recs[..., vb:].astype(jnp.int32) - 127)
        return dequant(q, s, self.block)


@dataclass(frozen=True)
class MlaRecord584:
    """V4 ``fp8_ds_mla``: per entry 448 e4m3 NoPE + 64 bf16 rope (576 B), plus 7 UE8M0 exponent
    bytes (e+127, one per 64 NoPE dims) and a zero pad byte; page = [bs x 576 B][bs x 8 B].

    NoPE values are rounded to bf16 before amax (vLLM); floor 1e-4; RoPE dims stay bf16.
    """

    entries_per_page: int
    nope_dim: int = 448
    rope_dim: int = 64
    block: int = 64
    dtype: jnp.dtype = jnp.uint8

    @property
    def data_bytes(self) -> int:
        return self.nope_dim + 2 * self.rope_dim

    @property
    def n_scales(self) -> int:
        return self.nope_dim // self.block

    @property
    def scale_bytes(self) -> int:
        return self.n_scales + 1

    @property
    def page_elems(self) -> int:
        return self.entries_per_page * (self.data_bytes + self.scale_bytes)

    def segments(self, slots: jax.Array) -> tuple[tuple[jax.Array, int], ...]:
        page, j = slots // self.entries_per_page, slots % self.entries_per_page
        base = page * self.page_elems
        return ((base + j * self.data_bytes, self.data_bytes),
                (base + self.entries_per_page * self.data_bytes + j * self.scale_bytes, self.scale_bytes))

    def offsets(self, slots: jax.Array) -> jax.Array:
        return offsets_from_segments(self.segments(slots))

    def pack(self, rows: jax.Array) -> jax.Array:
        nope = rows[..., : self.nope_dim].astype(jnp.bfloat16).astype(jnp.float32)
        pe = rows[..., self.nope_dim:]
        nb = nope.reshape(nope.shape[:-1] + (self.n_scales, self.block))
        s = block_scale(jnp.max(jnp.abs(nb), axis=-1), "ue8m0", 1e-4)
        q = quantize_e4m3(nb / s[..., None]).reshape(nope.shape)
        _, e = jnp.frexp(s)  # s = 0.5 * 2^e exactly -> exponent e-1
        ebytes = (e - 1 + 127).astype(jnp.uint8)
        pad = jnp.zeros(ebytes.shape[:-1] + (1,), jnp.uint8)
        return jnp.concatenate([_bytes(q), _bytes(pe.astype(jnp.bfloat16)), ebytes, pad], axis=-1)

    def unpack(self, recs: jax.Array) -> jax.Array:
        q = _from_bytes(recs[..., : self.nope_dim], FP8).astype(jnp.float32)
        pe = _from_bytes(recs[..., self.nope_dim: self.data_bytes], jnp.bfloat16).astype(jnp.float32)
        e = recs[..., self.data_bytes: self.data_bytes + self.n_scales].astype(jnp.int32) - 127
        s = jnp.ldexp(jnp.ones(e.shape, jnp.float32), e)
        nope = (q.reshape(q.shape[:-1] + (self.n_scales, self.block)) * s[..., None]).reshape(q.shape)
        return jnp.concatenate([nope, pe], axis=-1)
