"""Batched token sampling on the device (pure JAX), so a step's sampled ids never wait for the host.

Same rules as the host sampler ``jds.engine.sampling.sample``: greedy rows take the argmax (lowest id
among equal maxima, like ``np.argmax``); the others divide by the temperature, keep the ``top_k`` best
(ties by id), then the smallest prefix of that sorted list whose probability reaches ``top_p``, and draw
from what is left. Randomness comes from a threefry key built from the request seed and folded with the
output index, so a token depends only on (seed, index, logits): not on the batch or on preemptions.
The two samplers use different generators, so seeded draws agree in distribution, not token by token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def split_seeds(seeds: np.ndarray) -> np.ndarray:
    """uint64 request seeds -> [R, 2] uint32 (high, low) threefry key words (host side)."""
    s = np.asarray(seeds, np.uint64)
    return np.stack([(s >> np.uint64(32)).astype(np.uint32), (s & np.uint64(0xFFFFFFFF)).astype(np.uint32)], -1)


def _sample_row(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                key_words: jax.Array, index: jax.Array) -> jax.Array:
    v = logits.shape[0]
    x = logits / temperature
    ids = lax.iota(jnp.int32, v)
    # Descending by value, ties by id: the candidate order is deterministic (as in the host sampler).
    neg_sorted, order = lax.sort((-x, ids), num_keys=2)
    xs = -neg_sorted
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    allowed = ids < k
    z = jnp.where(allowed, xs - xs[0], -jnp.inf)
    p = jnp.exp(z)
    p = p / p.sum()
    before = jnp.cumsum(p) - p  # mass strictly before each candidate
    allowed &= (top_p >= 1.0) | (before < top_p)  # smallest prefix whose mass reaches top_p
    key = jax.random.fold_in(jax.random.wrap_key_data(key_words, impl="threefry2x32"), index)
    j = jax.random.categorical(key, jnp.where(allowed, z, -jnp.inf))
    return order[j]


@jax.jit
def sample_tokens(logits: jax.Array, greedy: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, key_words: jax.Array, index: jax.Array) -> jax.Array:
    """Token ids [R] int32 from logits [R, V].

    Per row: ``greedy`` bool, ``temperature`` f32 (ignored when greedy), ``top_k`` int32 (<= 0: off),
    ``top_p`` f32 in (0, 1], ``key_words`` [R, 2] uint32 (``split_seeds`` of the request seed),
    ``index`` int32 output position. A step whose rows are all greedy should call ``greedy_tokens``,
    which skips the full-vocabulary sort and needs none of these arrays.
    """
    logits = logits.astype(jnp.float32)
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temp = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    drawn = jax.vmap(_sample_row)(logits, temp, top_k.astype(jnp.int32), top_p.astype(jnp.float32),
                                  key_words.astype(jnp.uint32), index.astype(jnp.int32))
    return jnp.where(greedy, best, drawn.astype(jnp.int32))


@jax.jit
def greedy_tokens(logits: jax.Array) -> jax.Array:
    """Argmax ids [R] int32 of logits [R, V] (the all-greedy step: no per-row parameters to transfer)."""
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


@jax.jit
def greedy_tokens_host(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``greedy_tokens``, plus the ids copied into pinned host memory by the same executable: reading those
    back needs no device-to-host transfer call after the step (the copy is the executable's last command)."""
    ids = greedy_tokens(logits)
    return ids, jax.device_put(ids, jax.memory.Space.Host)


@jax.jit
def sample_tokens_host(logits: jax.Array, greedy: jax.Array, temperature: jax.Array, top_k: jax.Array,
                       top_p: jax.Array, key_words: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``sample_tokens``, plus the ids in pinned host memory (as ``greedy_tokens_host``)."""
    ids = sample_tokens(logits, greedy, temperature, top_k, top_p, key_words, index)
    return ids, jax.device_put(ids, jax.memory.Space.Host)
