"""Independent float64 numpy re-derivation of DeepSeek-V4's MTP module around its block (``jds.mtp``).

Written from the release's ``inference/model.py`` as read (V4-Flash mirror at commit 0825add: ``MTPBlock.forward``
lines 758-767, ``ParallelHead.forward`` / ``hc_head`` / ``get_logits`` 716-737, ``RMSNorm`` 183-196), never by
calling the JAX code; the block in between is ``tests.test_v4_block.np_block`` (itself a re-derivation).
Rounding points of the release, mirrored with ``rnd`` (round float64 to the activation dtype and back): the
embedding rows are stored in the activation dtype; each RMSNorm output, each linear's output and the bf16 sum
``e_proj(e) + h_proj(x)``; the HC head's output; the final norm's output. Everything else is float64 here.
Alongside each value the functions return an elementwise bound on how far a correct float32 / bf16
implementation may be from it, built from unit round-offs only (see ``combine``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

U32 = 2.0 ** -24  # float32 unit round-off


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * w


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def combine(emb_rows: np.ndarray, streams: np.ndarray, p: dict[str, np.ndarray], eps: float,
            rnd: Callable[[np.ndarray], np.ndarray], ulp: Callable[[np.ndarray], np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray]:
    """MTPBlock.forward's input mixing: x_j = e_proj(enorm(e)) + h_proj(hnorm(stream_j)) for every stream j.

    Returns (x [T, hc, d], bound [T, hc, d]). The bound: each rounded stage may land one ulp away (its input
    differs by float32 noise, flipping the rounding), and an input that is off by b moves a linear's output by
    at most |W| b; float32 accumulation adds n u sum|w x| (the classic gamma_n bound)."""
    n = emb_rows.shape[-1]
    e = rnd(rms_norm(emb_rows, p["enorm"], eps))
    h = rnd(rms_norm(streams, p["hnorm"], eps))
    ep = rnd(e @ p["e_proj"].T)
    hp = rnd(h @ p["h_proj"].T)
    x = rnd(ep[:, None, :] + hp)
    be = ulp(e) + n * U32 * np.abs(e)
    bh = ulp(h) + n * U32 * np.abs(h)
    bep = ulp(ep) + (be + n * U32 * np.abs(e)) @ np.abs(p["e_proj"]).T
    bhp = ulp(hp) + (bh + n * U32 * np.abs(h)) @ np.abs(p["h_proj"]).T
    return x, ulp(x) + bep[:, None, :] + bhp


def head(streams: np.ndarray, p: dict[str, np.ndarray], lm_head: np.ndarray, norm_eps: float, hc_eps: float,
         rnd: Callable[[np.ndarray], np.ndarray], ulp: Callable[[np.ndarray], np.ndarray]
         ) -> tuple[np.ndarray, np.ndarray]:
    """ParallelHead.forward with the MTP's ``hc_head_{fn,scale,base}`` and ``norm`` and the shared head weight:
    pre = sigmoid(fn . flat(x) / rms(flat(x)) * scale + base) + hc_eps, y = sum_j pre_j x_j (rounded), logits =
    norm(y) (rounded) @ head^T in float32. Returns (logits [T, V], bound [T, V]).

    The bound: a rounding flip of y_j (<= ulp(y_j)) changes norm(y)_j by that much times |w_j| / rms(y), and the
    rms itself by at most max_j ulp(y_j) / |y_j| relative; norm(y)_j may flip by ulp too; the float32 mixes
    (hc*d terms) and the logits' float32 sum (d terms) add their gamma_n noise."""
    t, hc, d = streams.shape
    flat = streams.reshape(t, hc * d)
    rs = 1.0 / np.sqrt(np.mean(flat ** 2, axis=-1, keepdims=True) + norm_eps)
    mixes = flat @ p["hc_head.fn"].T * rs
    pre = sigmoid(mixes * p["hc_head.scale"][0] + p["hc_head.base"]) + hc_eps
    y64 = (pre[..., None] * streams).sum(axis=-2)
    # the mixes' float32 noise moves pre by at most sigmoid' (<= 1/4) * scale * that noise
    em = (hc * d + 4) * U32 * (np.abs(flat) @ np.abs(p["hc_head.fn"]).T) * rs
    dpre = 0.25 * abs(p["hc_head.scale"][0]) * em + (hc + 2) * U32 * pre  # [T, hc]
    by = ulp(rnd(y64)) + (dpre[..., None] * np.abs(streams)).sum(axis=-2)
    y = rnd(y64)
    ry = 1.0 / np.sqrt(np.mean(y ** 2, axis=-1, keepdims=True) + norm_eps)
    xn = rnd(y * ry * p["norm"])
    rel = np.max(by / np.maximum(np.abs(y), 1e-30), axis=-1, keepdims=True)  # worst relative move of rms(y)
    bxn = ulp(xn) + by * ry * np.abs(p["norm"]) + np.abs(xn) * (rel + 4 * U32)
    logits = xn @ lm_head.T
    return logits, (bxn + d * U32 * np.abs(xn)) @ np.abs(lm_head).T
