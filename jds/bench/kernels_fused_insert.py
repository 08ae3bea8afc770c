"""Benchmark of the fused norm / RoPE / cache-insert kernels against their XLA implementations, at real
DeepSeek-V3.2 / V4 dims (bf16 activations, FP8 caches, DeepSeek reference numerics: Hadamard on, UE8M0).

Driven by ``python -m jds.bench.kernels`` (``--only fused_insert``). Rows: kernel, case, impl ("pallas" | "xla"),
median_us / p10_us / p90_us (jds.bench.timing.time_fn), device_unrolled_us (device_time_us: the
call repeated inside one executable, dispatch excluded; rows under ``device_row``'s ``below_us``),
profile_span_us / profile_busy_us (on a GPU: the call's device time from the GPU's timeline,
``timing.profiled_device_us``, the caches threaded as in the timed calls), bytes
(compulsory HBM traffic: every input read once, every output written once; caches count only the records
written), flops 0.

On the GPU, each kernel at T = 8192 is also timed with the tile variants of ``SWEEP`` (rows with a
``tiles`` field, ``matches_default``: outputs bit-identical to the default tiling, and ``bytes_differing``
of ``out_bytes``).

Caches are donated and threaded from call to call (each call updates the previous call's cache in place),
so neither implementation pays for a cache copy. Slots are a shuffled permutation (decode-like scatter).

Off-GPU the kernels only run in GPU interpret mode: with ``quick`` their rows are produced from a few
interpreted runs (marked ``interpret: true`` — functional smoke, not performance); without ``quick`` the
pallas rows are skipped with a message on stderr.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jds.config import V32Config, V4Config
from jds.ops.records import IndexerRecord132, MlaRecord584, MlaRecord656
from jds.ops.rope import cached_inv_freqs, rope_cos_sin
from pallas_kernels.fused_insert_v32 import fused_kv_insert_v32, fused_q_v32
from pallas_kernels.fused_insert_v4 import fused_qnorm_rope_kv_insert_v4
from jds.bench.timing import device_row, profiled_device_us, time_fn

BF16, F32 = jnp.bfloat16, jnp.float32


def _threaded(step: Callable[..., Any], cache_pos: tuple[int, ...], args: list[Any], out_pos: tuple[int, ...]):
    """A no-argument callable running ``step(*args)`` with the caches at ``cache_pos`` donated and replaced
    by the outputs at ``out_pos`` after each call."""
    state = list(args)

    def run():
        outs = step(*state)
        for i, o in zip(cache_pos, out_pos):
            state[i] = outs[o]
        return outs

    return run


def _cases(quick: bool, ts: tuple[int, ...] | None = None):
    """(kernel, case, fn, static kwargs, args, cache positions, output positions, bytes) per token count ``ts``
    (default: the benchmark's)."""
    ts = ts or ((1, 64) if quick else (1, 64, 1024, 8192))
    v32, v4 = V32Config.deepseek_v32(), V4Config.deepseek_v4_flash()
    for t in ts:
        rng = np.random.default_rng(t)
        pos = jnp.asarray(rng.integers(0, 100_000, t), jnp.int32)
        # --- V3.2 kv latent + indexer key insert ---
        cos, sin = rope_cos_sin(cached_inv_freqs(v32.rope, 64), pos)
        bs = v32.block_size
        nb = -(-t // bs) + 1
        slots = jnp.asarray(rng.permutation(nb * bs)[:t], jnp.int32)
        kvf, ixf = MlaRecord656(bs, "ue8m0"), IndexerRecord132(bs)
        args = [jnp.asarray(rng.normal(size=(t, 576)), BF16), jnp.asarray(rng.normal(size=(t, 128)), BF16),
                cos, sin, slots, jnp.zeros((nb, kvf.page_elems), jnp.uint8), jnp.zeros((nb, ixf.page_elems), jnp.uint8),
                jnp.ones(512, F32), jnp.ones(128, F32), jnp.zeros(128, F32)]
        nbytes = t * (576 * 2 + 128 * 2 + 64 * 4 + 4 + kvf.record_bytes + 132)
        static = dict(kv_format=kvf, index_format=ixf, eps=1e-6, dtype=BF16, indexer_interleave=False, hadamard=True)
        yield ("v32_kv_insert", f"T={t} fp8_ds_mla656+indexer132 hadamard", fused_kv_insert_v32, static, args,
               (5, 6), (0, 1), nbytes)
        # --- V3.2 q_pe RoPE + indexer q ---
        h, hi = v32.n_heads, v32.index_n_heads
        args = [jnp.asarray(rng.normal(size=(t, h, 192)), BF16), jnp.asarray(rng.normal(size=(t, hi, 128)), BF16),
                jnp.asarray(rng.normal(size=(t, hi)), F32), cos, sin]
        nbytes = t * (h * 64 * 2 * 2 + hi * 128 * 2 + hi * 4 + 64 * 4 + hi * 128 + 2 * hi * 4)
        static = dict(nope_dim=128, dtype=BF16, indexer_interleave=False, hadamard=True, fp8=True)
        yield "v32_fused_q", f"T={t} H=128 Hi=64 hadamard fp8", fused_q_v32, static, args, (), (), nbytes
        # --- V4 q head norm + RoPE, window insert ---
        cos, sin = rope_cos_sin(cached_inv_freqs(v4.rope_for(4), 64), pos)
        bs = v4.block_size
        nb = -(-t // bs) + 1
        slots = jnp.asarray(rng.permutation(nb * bs)[:t], jnp.int32)
        wf = MlaRecord584(bs)
        args = [jnp.asarray(rng.normal(size=(t, v4.n_heads, 512)), BF16), jnp.asarray(rng.normal(size=(t, 512)), BF16),
                cos, sin, slots, jnp.zeros((nb, wf.page_elems), jnp.uint8), jnp.ones(512, F32)]
        nbytes = t * (v4.n_heads * 512 * 2 * 2 + 512 * 2 + 64 * 4 + 4 + 584)
        static = dict(window_format=wf, eps=1e-6, dtype=BF16)
        yield ("v4_qnorm_rope_kv_insert", f"T={t} H=64 fp8_ds_mla584", fused_qnorm_rope_kv_insert_v4, static, args,
               (5,), (1,), nbytes)


def benchmark(quick: bool) -> Iterator[dict]:
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:
        msg = ("pallas rows run in GPU interpret mode (functional smoke, not performance)" if quick
               else "pallas rows skipped: no GPU (run with --quick for an interpret-mode smoke run)")
        print(f"jds.bench.kernels_fused_insert: backend {jax.default_backend()}: {msg}", file=sys.stderr, flush=True)
    for kernel, case, fn, static, args, cache_pos, out_pos, nbytes in _cases(quick):
        for impl in ("pallas", "xla"):
            interpret = impl == "pallas" and not on_gpu
            if interpret and not quick:
                continue
            kw = dict(static, implementation=impl)
            if impl == "pallas":
                kw["interpret"] = interpret
            call = functools.partial(fn, **kw)
            step = jax.jit(call, donate_argnums=cache_pos)
            # fresh copies: the donated caches of one impl must not be the other's inputs
            run = _threaded(step, cache_pos, [jnp.array(a, copy=True) for a in args], out_pos)
            t = time_fn(run, warmup=1 if interpret else 5, iters=3 if interpret else 50)
            t.update(device_row(call, *[jnp.array(a, copy=True) for a in args],
                                median_us=t["median_us"], thread=tuple(zip(cache_pos, out_pos)), quick=quick))
            if on_gpu:  # the GPU timeline's device time per call (the method; the others are host-timed)
                t.update(profiled_device_us(call, *args, thread=tuple(zip(cache_pos, out_pos))))
            yield {"kernel": kernel, "case": case, "impl": impl, **t, "bytes": nbytes, "flops": 0,
                   "interpret": interpret}
        if on_gpu and not quick and case.startswith("T=8192"):
            yield from _sweep(kernel, case, fn, static, args, cache_pos, out_pos, nbytes)


# Tile parameters of each kernel tried at T = 8192 beside its default. The defaults (v32_kv_insert: 16 tokens,
# 4 warps; v32_fused_q: 1 token, 4 warps; V4: 8 heads x 1 token, 8 warps) were the fastest variants at T = 8192
# (benchmarks/results/archive/kernels_fused_insert_*.json, rows with ``tiles``); the first variant of each is the
# previous default.
SWEEP = {"v32_kv_insert": [dict(block_tokens=16, num_warps=8), dict(block_tokens=32), dict(block_tokens=64)],
         "v32_fused_q": [dict(rows_per_program=256, num_warps=8), dict(rows_per_program=64, num_warps=8),
                         dict(rows_per_program=256, num_warps=4), dict(rows_per_program=512, num_warps=4)],
         "v4_qnorm_rope_kv_insert": [dict(rows_per_program=16, heads_per_program=16, num_warps=4),
                                     dict(rows_per_program=8, num_warps=8),
                                     dict(rows_per_program=32, heads_per_program=16, num_warps=4),
                                     dict(rows_per_program=16, heads_per_program=16, num_warps=2),
                                     dict(rows_per_program=32, heads_per_program=32, num_warps=4),
                                     dict(rows_per_program=16, heads_per_program=16, num_warps=8),
                                     dict(rows_per_program=32, heads_per_program=32, num_warps=8)]}


def _bytes(x: jax.Array) -> jax.Array:
    """The raw bytes of ``x`` (float8 / bf16 / f32 / uint8 alike), flattened."""
    return jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint8).reshape(-1)


def _sweep(kernel: str, case: str, fn, static: dict, args: list, cache_pos: tuple, out_pos: tuple,
           nbytes: int) -> list[dict]:
    """Pallas rows for the SWEEP variants: device time, plus whether the outputs equal the default
    variant's bit for bit (a variant that fails to compile gets its error instead)."""
    ref = jax.jit(functools.partial(fn, **static, implementation="pallas"))(*args)
    rows = []
    for tiles in SWEEP[kernel]:
        f = functools.partial(fn, **static, implementation="pallas", **tiles)
        row = {"kernel": kernel, "case": f"{case} " + " ".join(f"{k}={v}" for k, v in tiles.items()),
               "impl": "pallas", "tiles": tiles, "bytes": nbytes, "flops": 0, "interpret": False}
        try:
            jf = jax.jit(f)
            got = jf(*args)
            pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
            # a different tile shape changes Triton's reduction trees / MMA shapes, so a rare rounding flip
            # (one e4m3 byte) is expected; the count tells that from a wrong write
            row["bytes_differing"] = sum(int(jnp.sum(_bytes(a) != _bytes(b))) for a, b in pairs)
            row["matches_default"] = row["bytes_differing"] == 0
            row["out_bytes"] = sum(int(a.nbytes) for a, _ in pairs)
            t = time_fn(jf, *args, warmup=3, iters=20)
            t.update(device_row(f, *args, median_us=t["median_us"], thread=tuple(zip(cache_pos, out_pos))))
            t.update(profiled_device_us(f, *args, thread=tuple(zip(cache_pos, out_pos))))
            row.update(t)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result, not a crash
            row["error"] = str(e).splitlines()[0][:300]
        rows.append(row)
    return rows
