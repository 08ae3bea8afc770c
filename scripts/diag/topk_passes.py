"""How many counting passes the split top-k's finish makes over its candidate buffers before the candidates fit
the shrunk block, with the whole-key-space start and with ``range_margin``'s start from the pivot (CPU, numpy).

    python scripts/diag/topk_passes.py [--rows 64] [--n 65536] [--k 2048] [--margins 0 1 2] [--scale 1 0.01 100] [--pivot-bits 16]

Why: each pass before the shrink reads every candidate buffer (latency-bound L2 round trips on the H200), the
passes after it count one block held in registers. This replays the kernel's pivot (``_sample_pivot``: evenly
spaced sample, ``_sample_rank``, 16-bit bucket floor) and its range arithmetic (``_kth_key``) on random normal
rows, so a start's pass counts are known before a GPU session times it. The kth key it finds is checked against
``np.partition``. It also counts the rows whose k-th key's first-pass bucket fits one 512-key block, the split
finish's fast path (``split_finish``), at one margin, at a margin and the next (``_first_pass``), and with one
coarser margin too (``bucket_resolutions=3``), for buckets of ``--bucket-keys`` keys (``bucket_blocks``).
``--short L ...``: a decode batch's short rows instead (``short_rows``), with and without ``lengths``
(``--range-top-sigma 6``: with the range top, ``TopkSelectConfig.range_top_sigma``; ``--zero-band 3``: the first
pass's keys near zero as one value, ``zero_band``, the indexer's 3 binades), and the bucket the split finish then
counts: its keys and passes.
"""

from __future__ import annotations

import argparse

import numpy as np

from pallas_kernels.topk_select import _NEG_INF_U, _sample_rank, _top_rank


def ordered(x: np.ndarray) -> np.ndarray:
    """jds.ops.select.ordered_key in numpy: uint32, ordered as the floats are."""
    b = x.astype(np.float32).view(np.uint32)
    return np.where(b >> 31 == 1, ~b, b | np.uint32(1 << 31)).astype(np.uint32)


def pivot(u: np.ndarray, k: int, sample: int = 1024, pivot_bits: int = 16, n: int | None = None,
          top_sigma: float | None = None, top_bits: int = 12) -> tuple[int, int]:
    """(u of the pivot, u of the counting range's top) over the first ``n`` keys (all of them if None): the sample's
    largest key, or with ``top_sigma`` (``range_top_sigma``) and a range across the sign, the top of the bucket
    of the sample's ``_top_rank``-th key."""
    n = u.size if n is None else n
    su = u[(np.arange(sample) * n) // sample]
    r = _sample_rank(n, k, sample)
    floor = int(np.sort(su)[::-1][r - 1]) >> (32 - pivot_bits) << (32 - pivot_bits)
    piv, hi = int(su[su >= floor].min()), int(su.max())
    if top_sigma is not None:
        top = _top_rank(n, k, sample, top_sigma)
        if top > 1 and piv < 1 << 31 <= hi and piv != _NEG_INF_U:
            hi = int(np.sort(su)[::-1][top - 1]) | ((1 << (32 - top_bits)) - 1)
    return piv, hi


def pivot_start(piv: int, hi: int, margin: int, bits: int = 4) -> tuple[int, int, int]:
    """(lo, span, shift) of the counting's start from the pivot (``_pivot_range``): digits 2^-(bits + margin) of
    the span up to the sample's largest key, at least 1 bit, at most what the whole span needs."""
    span = 0xFFFFFFFF - piv
    return piv, span, min(max((hi - piv).bit_length() - bits - margin, 1), max(span.bit_length() - bits, 0))


def passes(cand: np.ndarray, k: int, lo: int, span: int, shift: int, width: int = 512, bits: int = 4,
           exit_one: bool = False) -> tuple[int, int, int]:
    """(passes before the candidates fit ``width``, passes in all, the k-th key) for the range arithmetic;
    ``exit_one`` (``TopkSelectConfig.exit_at_one``): once the k-th key's digit holds one key, one more pass (the
    masked max) takes it."""
    nd, k_rem, full, total, prev = 1 << bits, k, None, 0, shift
    cand = cand.astype(np.int64)
    while True:
        total += 1
        inside = (cand >= lo) & (cand - lo <= span)
        dig = np.minimum((cand[inside] - lo) >> shift, nd - 1)
        ge = np.array([(dig >= d).sum() for d in range(nd)])
        sel = int((ge >= k_rem).sum()) - 1
        above = int(ge[sel + 1]) if sel + 1 < nd else 0
        base = sel << shift
        rest, bucket = span - base, (1 << shift) - 1
        clamped = sel == nd - 1 and span >> shift > nd - 1  # the open top digit: keys past the digits' reach
        span = rest if sel == nd - 1 else min(rest, bucket)
        lo += base
        k_rem -= above
        if full is None and int(ge[sel]) - above <= width:
            full = total
        if span == 0:
            return full if full is not None else total, total, lo
        if exit_one and int(ge[sel]) - above == 1:
            return full, total + 1, int(cand[(cand >= lo) & (cand - lo <= span)].max())
        shift = max(span.bit_length() - bits, 0)
        if clamped:  # grow the digits 2^bits-fold from where they stopped, not the whole rest of the key space at once
            shift = min(shift, prev + bits)
        prev = shift


def zero_band(piv: int, hi: int, binades: int | None) -> tuple[int, int]:
    """(ra, gap) of ``_zero_band``: keys u in [piv + ra, piv + ra + gap] (magnitudes below a power of 2 ``binades``
    under the pivot's and the top's smaller one) count as one value where the range crosses the sign, else (0, 0)."""
    if binades is None or not (piv < 1 << 31 <= hi and piv != _NEG_INF_U):
        return 0, 0
    bw = max((min(~piv & 0x7FFFFFFF, hi & 0x7FFFFFFF) >> 23) - binades, 0) << 23
    return (0x7FFFFFFF - bw) - piv, 2 * bw + 1


def first_bucket(cand: np.ndarray, k: int, piv: int, hi: int, margin: int, band: int | None = None,
                 detail: bool = False) -> int | tuple[int, int, int, int] | None:
    """Keys in the k-th key's first-pass bucket at ``margin`` (``_first_pass``), None if fewer than k are in range;
    ``band``: over ``zero_band``'s coordinates (``TopkSelectConfig.zero_band``). ``detail``: (keys, the bucket's
    first u, its span, keys above it), the bucket as ``_band_bucket`` / ``_next_range`` give it (a bucket reaching the
    band holds all of it)."""
    ra, gap = zero_band(piv, hi, band)
    lo, span, shift = pivot_start(piv, hi, margin)
    c = cand.astype(np.int64)
    if gap:  # _band_start: the span and the top less the band's width
        f = lambda r: r - np.clip(r - ra, 0, gap)  # noqa: E731
        span -= gap
        shift = min(max(int(f(np.int64(hi - piv))).bit_length() - 4 - margin, 1), max(span.bit_length() - 4, 0))
        c = lo + f(c - lo)
    inside = (c >= lo) & (c - lo <= span)
    dig = np.minimum((c[inside] - lo) >> shift, 15)
    ge = np.array([(dig >= d).sum() for d in range(16)])
    sel = int((ge >= k).sum()) - 1
    if sel < 0:
        return None
    if not detail:
        return int((dig == sel).sum())
    flo = sel << shift  # the digit's range in the first pass's coordinates, then its preimage in u
    fhi = flo + (span - flo if sel == 15 else min(span - flo, (1 << shift) - 1))
    blo, bhi = (flo + gap if ra < flo else flo, fhi if fhi < ra else fhi + gap) if gap else (flo, fhi)
    return int((dig == sel).sum()), lo + blo, bhi - blo, int(ge[sel + 1]) if sel < 15 else 0


def short_rows(a: argparse.Namespace) -> None:
    """--short: rows of L normal keys then -inf to n (a decode batch's short request), with the split prefilter's
    sample over the whole row and, with topk_select's ``lengths`` hint, over its first max(L, k, sample) keys: the
    candidates, and the rows whose first-pass bucket fits ``--bucket-keys`` keys at margins 0..2 (the split finish's
    fast path; otherwise the one-program finish runs). Then, per length, the bucket the split finish takes as
    ``_first_pass`` picks it (the finest margin whose bucket fits the largest ``--bucket-keys``, the indexer's
    1024-key scratch): its keys (mean and largest) and the counting passes from its range to tau, without and with
    ``exit_at_one`` (its max pass counted as one)."""
    rng = np.random.default_rng(0)
    room = max(a.bucket_keys)
    for hint in (False, True):
        out, picked = [], []
        for length in a.short:
            fits, cands, buckets, npass = 0, [], [], []
            for _ in range(a.rows):
                x = np.full(a.n, -np.inf, np.float32)
                x[:length] = rng.standard_normal(length)
                u = ordered(x)
                piv, hi = pivot(u, a.k, pivot_bits=a.pivot_bits,
                                n=min(max(length, a.k, 1024), a.n) if hint else None, top_sigma=a.range_top_sigma)
                cand = u[u > piv] if piv == _NEG_INF_U else u[u >= piv]  # a -inf pivot keeps the keys above it
                cands.append(cand.size)
                found = [first_bucket(cand, a.k, piv, hi, m, a.zero_band, detail=True) for m in (0, 1, 2)]
                sizes = [None if d is None else d[0] for d in found]
                fits += cand.size >= a.k and min((b for b in sizes if b is not None), default=a.n) <= a.bucket_keys[0]
                if cand.size < a.k or piv == _NEG_INF_U or None in sizes:
                    continue  # another path: pivot is tau, or the row read again
                pick = found[0]
                for d in found[1:]:  # coarsest first; a finer one overrides where it fits
                    if d[0] <= room:
                        pick = d
                keys, lo, span, above = pick
                if keys <= room:
                    c = cand.astype(np.int64)
                    bc = cand[(c >= lo) & (c - lo <= span)]
                    buckets.append(keys)
                    npass.append([passes(bc, a.k - above, lo, span, max(span.bit_length() - 4, 0), exit_one=e)[1]
                                  for e in (False, True)])
            out.append(f"{length}: {fits}/{a.rows} ({int(np.mean(cands))})")
            if buckets:
                p, pe = np.mean(npass, axis=0)
                picked.append(f"{length}: {np.mean(buckets):.0f} / {max(buckets)} keys, {p:.2f} passes ({pe:.2f} "
                              f"with exit_at_one; {len(buckets)} rows)")
        print(f"N={a.n} k={a.k} {'lengths hint' if hint else 'no hint'}: rows whose bucket fits "
              f"{a.bucket_keys[0]} keys (mean candidates): " + ", ".join(out))
        if picked:
            print(f"  the split finish's bucket (of {room} keys at most; mean / largest) and its passes: "
                  + "; ".join(picked))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--margins", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--scale", type=float, nargs="+", default=[1.0])
    ap.add_argument("--pivot-bits", type=int, default=16)
    ap.add_argument("--bucket-keys", type=int, nargs="+", default=[512],
                    help="the split finish's bucket sizes to count fits for (bucket_blocks x hist_block)")
    ap.add_argument("--short", type=int, nargs="+", default=None,
                    help="instead: rows of this many finite keys then -inf (short_rows), with and without the hint")
    ap.add_argument("--range-top-sigma", type=float, default=None,
                    help="with --short: the counting range's top at the sampled key of rank m - sigma sqrt(m) - 4 "
                         "where the range crosses the sign (TopkSelectConfig.range_top_sigma; off in the indexer)")
    ap.add_argument("--zero-band", type=int, default=None,
                    help="with --short: the first pass's keys near zero as one value (TopkSelectConfig.zero_band; "
                         "the indexer's 3)")
    a = ap.parse_args()
    if a.short:
        return short_rows(a)
    rng = np.random.default_rng(0)
    for scale in a.scale:
        stats: dict[str, list[tuple[int, int]]] = {}
        fits: dict[str, list[bool]] = {}
        for _ in range(a.rows):
            u = ordered(rng.standard_normal(a.n) * scale)
            piv, hi = pivot(u, a.k, pivot_bits=a.pivot_bits)
            cand = u[u >= piv]
            want = int(np.partition(u, u.size - a.k)[u.size - a.k])
            starts = {"whole": (0, 0xFFFFFFFF, 28)}
            for m in a.margins:
                starts[f"margin{m}"] = pivot_start(piv, hi, m)
            for name, st in starts.items():
                full, total, tau = passes(cand, a.k, *st)
                assert tau == want, (name, tau, want)
                stats.setdefault(name, []).append((full, total))
            # the split finish's fast path: the k-th key's first-pass bucket fits one block, at margin m or, with
            # the pair, at m or m + 1 (_first_pass)
            size = {m: first_bucket(cand, a.k, piv, hi, m)
                    for m in range(max(min(a.margins) - 1, 0), max(a.margins) + 2)}
            for keys in a.bucket_keys:
                for m in a.margins:
                    fits.setdefault(f"margin{m}, {keys} keys", []).append(size[m] <= keys)
                    fits.setdefault(f"margins{m}+{m + 1}, {keys} keys", []).append(min(size[m], size[m + 1]) <= keys)
                    if m >= 1:  # TopkSelectConfig.bucket_resolutions=3: one coarser first pass too
                        fits.setdefault(f"margins{m - 1}..{m + 1}, {keys} keys", []).append(
                            min(size[m - 1], size[m], size[m + 1]) <= keys)
        print(f"N={a.n} k={a.k} scale={scale}: candidates per row about {cand.size}")
        for name, v in stats.items():
            f, t = np.array(v).T
            print(f"  {name:8s} passes over the buffers before the shrink: mean {f.mean():.2f} (max {f.max()}),"
                  f" passes in all: mean {t.mean():.2f}")
        for name, v in fits.items():
            print(f"  first-pass bucket fits, {name}: {sum(v)} of {len(v)} rows")


if __name__ == "__main__":
    main()
