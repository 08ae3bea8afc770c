"""Triton kernels of the torch comparator, where a fused op replaces a chain of torch ops.

``paged_indexer_logits``: the lightning indexer's logits read straight from the paged 132-byte FP8 key
cache through the block table; the stand-in for DeepGEMM's ``fp8_paged_mqa_logits``. The torch-op
path (``torch_kernels.gather_request_rows`` + ``indexer_logits``) first materialises every request's
dequantised fp32 keys and every token's [heads, keys] dot products; this kernel keeps both in registers.
Expected gap to DeepGEMM: its FP8 tensor-core MMAs against fp32 FMA-precision dots here ("ieee", the
jds semantics), so a few times DeepGEMM's time at long contexts; well below the torch-op path's.

Off a GPU, Triton's interpreter (TRITON_INTERPRET=1, read by Triton when the module is imported) runs
the kernel on the CPU; tests/test_compare_torch.py does so in a subprocess.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr, vals_ptr, scales_ptr, bt_ptr, req_ptr, out_ptr, n_keys, n_heads,
                           bt_cols, page_elems, EPP: tl.constexpr, D: tl.constexpr, HP: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_keys
    req = tl.load(req_ptr + t)
    page = tl.load(bt_ptr + req * bt_cols + offs_n // EPP, mask=n_ok, other=0).to(tl.int64)
    j = (offs_n % EPP).to(tl.int64)
    base = page * page_elems
    d = tl.arange(0, D)
    k8 = tl.load(vals_ptr + base[:, None] + j[:, None] * D + d[None, :], mask=n_ok[:, None], other=0)
    k = k8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = tl.load(scales_ptr + (base + EPP * D + j * 4) // 4, mask=n_ok, other=0.0)
    k = k * s[:, None]  # [BLOCK_N, D] dequantised keys
    h = tl.arange(0, HP)
    h_ok = h < n_heads
    q = tl.load(q_ptr + t * n_heads * D + h[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0)
    dots = tl.dot(q, tl.trans(k), input_precision="ieee")  # [HP, BLOCK_N]
    w = tl.load(w_ptr + t * n_heads + h, mask=h_ok, other=0.0)
    logits = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
    tl.store(out_ptr + t * n_keys + offs_n, logits, mask=n_ok)


def paged_indexer_logits(q: torch.Tensor, w: torch.Tensor, storage: torch.Tensor, fmt: Any,
                         block_tables: torch.Tensor, req_idx: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """q [T, Hi, D] fp32 (FP8-dequantised), w [T, Hi] fp32, ``storage`` the flat uint8 cache of
    ``IndexerRecord132`` pages -> logits [T, N] fp32 over each token's request's N = cols * epp keys
    (unmasked: the caller masks keys beyond the token's position, as torch_kernels.topk_visible does)."""
    if type(fmt).__name__ != "IndexerRecord132":
        raise ValueError(f"paged_indexer_logits reads IndexerRecord132 pages, got {type(fmt).__name__}")
    t, hi, d = q.shape
    if d != fmt.dim or d & (d - 1):
        raise ValueError(f"q head dim {d} must equal the record's {fmt.dim} and be a power of two")
    n = block_tables.shape[1] * fmt.entries_per_page
    out = torch.empty((t, n), dtype=torch.float32, device=q.device)
    hp = max(16, triton.next_power_of_2(hi))
    grid = (t, triton.cdiv(n, block_n))
    _indexer_logits_kernel[grid](q.contiguous(), w.contiguous(), storage, storage.view(torch.float32),
                                 block_tables.contiguous(), req_idx.contiguous(), out, n, hi,
                                 block_tables.shape[1], fmt.page_elems, EPP=fmt.entries_per_page, D=d, HP=hp,
                                 BLOCK_N=block_n)
    return out
