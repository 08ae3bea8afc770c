"""The jds decoder stacks in PyTorch, loaded from a jds ``Decoder``'s own parameters, and a step runner
in vLLM's four boundary modes.

Weights: ``params_to_torch`` converts the Decoder's nnx parameter tree leaf by leaf (bf16 by its bits,
fp32 as is), so both sides hold bit-identical weights. Caches: the same record byte layouts
(656-byte V3.2 fp8_ds_mla, 584-byte V4 fp8_ds_mla, 132-byte indexer keys, or float rows) addressed through
the same block tables and slot mapping as ``jds.batch.PagedBatch`` (built by ``jds.batch.make_batch``).

Modes (``TorchStepRunner``), as vLLM places the CUDA-graph boundary:
  eager   no graphs
  wide    graphs around everything but the whole attention op (cache inserts, indexer, sparse MQA, W_UV
          run eagerly): vLLM's piecewise graphs before the upstream change
  narrow  the producers (norms, RoPE, W_UK, indexer q prep, cache inserts) inside the graphs; only the
          indexer logits + top-k and the sparse MQA + W_UV run eagerly between graph segments (breakable
          capture: each segment captured separately and replayed around the eager region)
  full    the whole step in one graph, for fixed shapes
Off a CUDA device every mode runs its segments eagerly (the same ops, so the same numbers), which is
how the CPU tests cover the graph modes' logic.

Numerics supported: ``Numerics`` with ``fp8_linear=False`` (bf16 or fp32 activations; fp8 or float
caches; FP8 indexer on or off; Hadamard on or off), i.e. ``bf16()``, ``exact()`` and ``serving()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from jds.compare import TORCH_MODES
from jds.compare import torch_kernels as K

Env = dict[str, torch.Tensor]


# ----- weights -------------------------------------------------------------------------------------
def to_torch(a: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    """A jax/numpy array -> torch tensor with the same bits (bf16 and fp8 through their raw bytes)."""
    a = np.array(a)  # a writable host copy
    name = a.dtype.name
    if name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(device)
    if name == "float8_e4m3fn":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(torch.float8_e4m3fn).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def params_to_torch(model: Any, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every nnx.Param of a jds ``Decoder`` as a torch tensor, keyed by its dotted path
    (``layers.0.attn.wq_a.weight``, ``layers.0.ffn.w1`` ...)."""
    from flax import nnx

    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and path:
            out[".".join(str(p) for p in path)] = to_torch(node.get_value(), device)
    return out


def fp8_out_features(model: Any) -> dict[str, int]:
    """{dotted path: out features} of a jds ``Decoder``'s FP8 linears whose stored weight has zero rows past their
    out features (whole 128-row scale blocks)."""
    from flax import nnx

    from jds.nn import Linear

    return {".".join(str(p) for p in path): node.out_features for path, node in nnx.iter_graph(model)
            if isinstance(node, Linear) and node.fp8 and node.out_features % 128}


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """The inverse of ``to_torch`` for caches and outputs (bf16 -> ml_dtypes bfloat16 by its bits)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# ----- the batch -----------------------------------------------------------------------------------
@dataclass
class StepInputs:
    """One step's device inputs, views of one int32 buffer filled by a single host-to-device copy."""

    buf: torch.Tensor
    host: torch.Tensor  # pinned staging copy on CUDA
    tokens: torch.Tensor
    positions: torch.Tensor
    req_idx: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    block_tables: torch.Tensor

    @staticmethod
    def alloc(t: int, r: int, w: int, device: torch.device) -> "StepInputs":
        n = 4 * t + r + r * w
        buf = torch.zeros(n, dtype=torch.int32, device=device)
        host = torch.zeros(n, dtype=torch.int32, pin_memory=device.type == "cuda")
        o = [0, t, 2 * t, 3 * t, 4 * t, 4 * t + r]
        return StepInputs(buf, host, buf[o[0]:o[1]], buf[o[1]:o[2]], buf[o[2]:o[3]], buf[o[3]:o[4]], buf[o[4]:o[5]],
                          buf[o[5]:].view(r, w))


def host_step(ids: np.ndarray, chunks: Sequence[Any], block_tables: np.ndarray, block_size: int
              ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The packed int32 host buffer of a step (the same positions / slots as ``jds.batch.make_batch``)
    and its shape key (tokens, request rows, block-table columns)."""
    from jds.batch import make_batch

    seq = max(c.start + c.num_tokens for c in chunks)
    w = -(-seq // block_size)
    bt = np.asarray(block_tables, np.int32)[: len(chunks), :w]
    rows = [c.req for c in chunks]
    if rows != list(range(len(chunks))):
        raise ValueError(f"chunks must be request rows 0..{len(chunks) - 1} in order, got {rows}")
    b = make_batch(chunks, bt, block_size, host=True)
    li = np.asarray(b.query_start_loc[1:], np.int32) - 1
    ids = np.asarray(ids, np.int32)
    if ids.shape != b.positions.shape:
        raise ValueError(f"ids has {ids.shape[0]} tokens, the chunks {b.positions.shape[0]}")
    buf = np.concatenate([ids, b.positions, b.req_idx, b.slot_mapping, li, bt.reshape(-1)]).astype(np.int32)
    return buf, (ids.shape[0], len(chunks), w)


# ----- layers --------------------------------------------------------------------------------------
class _Layer:
    """Shared FFN and residual halves; subclasses add the attention stages."""

    def __init__(self, cfg: Any, p: dict[str, torch.Tensor], prefix: str, device: torch.device,
                 indexer_kernel: str = "torch", out_features: dict[str, int] | None = None):
        if indexer_kernel not in ("torch", "triton"):
            raise ValueError(f"indexer_kernel must be 'torch' or 'triton', got {indexer_kernel!r}")
        self.indexer_kernel = indexer_kernel
        if cfg.numerics.wo_a_fp8 and cfg.arch == "v4":
            raise ValueError("numerics.wo_a_fp8=True (V4's grouped wo_a as an FP8 GEMM, a departure from the release) "
                             "is not implemented by the torch comparator")
        if cfg.numerics.indexer_fp4:
            raise ValueError("numerics.indexer_fp4=True (V4's MXFP4 indexer) is not implemented by the torch "
                             "comparator (its indexer records are the FP8 132-byte ones)")
        self.cfg, self.num, self.device = cfg, cfg.numerics, device
        self.dt = K.torch_dtype(cfg.numerics.dtype)
        self.eps = cfg.attn.rms_norm_eps
        self.w = {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}
        self.out = {k[len(prefix):]: n for k, n in (out_features or {}).items() if k.startswith(prefix)}
        self.moe = cfg.n_routed_experts > 0
        # FP8 routed experts (numerics.experts_fp8: e4m3 [E, out, in] + 128 x 128 scales), dequantised once to fp32
        # for the every-expert stand-in below; their inputs are re-quantised per 128 on every call, as jds's
        # grouped FP8 GEMM does
        self.experts_fp8 = {n: K.dequant_weight(self.w[f"ffn.{n}.weight"], self.w[f"ffn.{n}.scale"])
                            for n in ("w1", "w3", "w2")} if "ffn.w1.scale" in self.w else None
        self.h_mat = None
        if cfg.numerics.indexer_hadamard:
            from jds.ops.hadamard import hadamard_matrix  # the constant matrix (numpy), not jds's op

            self.h_mat = torch.from_numpy(hadamard_matrix(cfg.attn.index_head_dim).copy()).to(device)

    def indexer_logits(self, e: Env, b: Env, storage: torch.Tensor, fmt: Any, max_entries: int) -> torch.Tensor:
        """[T, max_entries] indexer logits: the Triton paged kernel (reads the FP8 pages in place) or the
        torch-op gather + GEMMs."""
        if self.indexer_kernel == "triton" and type(fmt).__name__ == "IndexerRecord132":
            from jds.compare.triton_kernels import paged_indexer_logits

            return paged_indexer_logits(e["index_q"], e["index_w"], storage, fmt, b["block_tables"], b["req_idx"])
        keys = K.gather_request_rows(storage, fmt, b["block_tables"], max_entries)
        return K.indexer_logits(e["index_q"], e["index_w"], keys, b["req_idx"])

    def lin(self, x: torch.Tensor, name: str, out_dtype: torch.dtype) -> torch.Tensor:
        """jds's ``Linear`` ``name``: x @ W^T, through ``K.fp8_linear`` where the weight is FP8 (it has a
        ``.scale``), cut to its out features."""
        w, s = self.w[name + ".weight"], self.w.get(name + ".scale")
        if s is None:
            return K.linear(x, w, out_dtype)
        y = K.fp8_linear(x, w, s, out_dtype, self.num.act_scale_fmt)
        return y[..., :self.out[name]] if name in self.out else y

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if not self.moe:
            return self._mlp(x, "ffn.")
        # router: fp32 sigmoid scores, normalised top-k weights
        scores = torch.sigmoid(self.lin(x.to(K.F32), "ffn.gate", K.F32))
        tw, idx = torch.topk(scores, self.cfg.moe_topk, dim=-1)
        tw = tw / tw.sum(-1, keepdim=True)
        dense = torch.zeros_like(scores).scatter_(1, idx, tw)  # [T, E] routing weight, 0 when unrouted
        # Every expert on every token (static shapes, graph-safe), weighted by its routing weight.
        # Stands in for vLLM's fused_moe Triton kernel (grouped GEMM over routed tokens only): expect about
        # n_routed_experts / moe_topk times the routed FLOPs.
        # fp32 math on the bf16 values: the fp32 accumulators of jds's ragged_dot, unrounded
        if self.experts_fp8 is not None:  # [E, out, in]; x and the activation quantised per 128 first
            fmt, e8 = self.num.act_scale_fmt, self.experts_fp8
            xd = K.dequant(*K.act_quant(x, 128, fmt), 128)
            g = torch.einsum("th,efh->etf", xd, e8["w1"])
            u = torch.einsum("th,efh->etf", xd, e8["w3"])
            a = (torch.nn.functional.silu(g) * u).to(x.dtype)
            y = torch.einsum("etf,ehf->eth", K.dequant(*K.act_quant(a, 128, fmt), 128), e8["w2"])
        else:
            xf = x.to(K.F32)
            g = torch.einsum("th,ehf->etf", xf, w["ffn.w1"].to(K.F32))
            u = torch.einsum("th,ehf->etf", xf, w["ffn.w3"].to(K.F32))
            a = (torch.nn.functional.silu(g) * u).to(x.dtype)
            y = torch.einsum("etf,efh->eth", a.to(K.F32), w["ffn.w2"].to(K.F32))
        routed = torch.einsum("te,eth->th", dense, y)
        return (routed + self._mlp(x, "ffn.shared.").to(K.F32)).to(x.dtype)

    def _mlp(self, x: torch.Tensor, pre: str) -> torch.Tensor:
        g = self.lin(x, pre + "w1", self.dt)
        a = torch.nn.functional.silu(g.to(K.F32)).to(x.dtype) * self.lin(x, pre + "w3", self.dt)
        return self.lin(a, pre + "w2", self.dt)

    def pre_attention(self, h: torch.Tensor) -> Env:
        return self.project_in(K.rms_norm(h, self.w["attn_norm.weight"], self.eps))

    def post_attention(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h = h + self.project_out(o).to(h.dtype)
        return h + self.ffn(K.rms_norm(h, self.w["ffn_norm.weight"], self.eps)).to(h.dtype)

    def project_in(self, x: torch.Tensor) -> Env:
        raise NotImplementedError

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class V32Layer(_Layer):
    """V3.2: MLA (absorbed) + lightning indexer over 656 / 132-byte (or float) caches."""

    def __init__(self, cfg: Any, p: dict[str, torch.Tensor], i: int, num_blocks: int, device: torch.device,
                 indexer_kernel: str = "torch", out_features: dict[str, int] | None = None):
        super().__init__(cfg, p, f"layers.{i}.", device, indexer_kernel, out_features)
        from jds.ops.rope import cached_inv_freqs  # host-side constant table (numpy)

        a = cfg.attn
        self.kv_fmt, self.index_fmt = v32_formats(cfg)
        self.kv_cache = K.new_storage(self.kv_fmt, num_blocks, device)
        self.index_cache = K.new_storage(self.index_fmt, num_blocks, device)
        self.inv_freqs = torch.from_numpy(cached_inv_freqs(a.rope, a.qk_rope_head_dim).copy()).to(device)
        w = self.w["attn.wkv_b.weight"]
        if "attn.wkv_b.scale" in self.w:  # an FP8 wkv_b dequantised and rounded once, as jds absorbs it
            w = K.dequant_weight(w, self.w["attn.wkv_b.scale"])[: a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)]
        w = w.to(self.dt).reshape(a.n_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        self.w_uk, self.w_uv = w[:, : a.qk_nope_head_dim].contiguous(), w[:, a.qk_nope_head_dim:].contiguous()

    def caches(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv_cache, "index_k": self.index_cache}

    def project_in(self, x: torch.Tensor) -> Env:
        x = x.to(self.dt)
        # wq_a, the indexer's wk and wkv_a as jds stores them: one GEMM (vLLM fuses wq_a with wkv_a)
        y = self.lin(x, "attn.wq_a_wk_wkv_a", self.dt)
        q, k = self.cfg.attn.q_lora_rank, self.cfg.attn.q_lora_rank + self.cfg.attn.index_head_dim
        return {"q_lat": y[:, :q], "index_k": y[:, q:k], "kv": y[:, k:k + self.cfg.attn.kv_record_dim],
                "index_w": self.lin(x.to(K.F32), "attn.indexer.weights_proj", K.F32)}

    def prepare(self, e: Env, b: Env) -> Env:
        """Norms, RoPE, W_UK absorption, indexer q prep and both cache inserts (vLLM: the fused
        q/kv-a layernorm, rotary, ``concat_and_cache_mla`` and ``indexer_k_quant_and_cache``)."""
        a, w, dt = self.cfg.attn, self.w, self.dt
        cos, sin = K.rope_cos_sin(self.inv_freqs, b["positions"])
        q_c = K.rms_norm(e["q_lat"], w["attn.q_norm.weight"], self.eps, dt)
        q = self.lin(q_c, "attn.wq_b", dt).reshape(-1, a.n_heads, a.qk_head_dim)
        q = K.rope_part(q, cos, sin, rope_dim=a.qk_rope_head_dim, first=False, interleaved=True)
        nope = a.qk_nope_head_dim
        q_lat = K.per_head("thd,hdc->thc", q[..., :nope], self.w_uk, dt)
        q = torch.cat([q_lat, q[..., nope:]], dim=-1)
        c = K.rms_norm(e["kv"][:, : a.kv_lora_rank], w["attn.kv_norm.weight"], self.eps, dt)
        k_pe = K.rope_part(e["kv"][:, a.kv_lora_rank:], cos, sin, rope_dim=a.qk_rope_head_dim, first=False,
                           interleaved=True)
        K.write_records(self.kv_cache, self.kv_fmt, b["slot_mapping"], torch.cat([c, k_pe], dim=-1))
        ilv = a.indexer_rope_interleave
        ki = K.layer_norm(e["index_k"], w["attn.indexer.k_norm.weight"], w["attn.indexer.k_norm.bias"], self.eps, dt)
        ki = K.rope_part(ki, cos, sin, rope_dim=a.qk_rope_head_dim, first=True, interleaved=ilv).to(dt)
        if self.h_mat is not None:
            ki = K.hadamard_rotate(ki, self.h_mat)
        K.write_records(self.index_cache, self.index_fmt, b["slot_mapping"], ki)
        qi = self.lin(q_c, "attn.indexer.wq_b", dt).reshape(-1, a.index_n_heads, a.index_head_dim)
        qi = K.rope_part(qi, cos, sin, rope_dim=a.qk_rope_head_dim, first=True, interleaved=ilv)
        qi, wi = K.prepare_indexer_q(qi, e["index_w"], head_dim=a.index_head_dim, n_heads=a.index_n_heads,
                                     fp8=self.num.indexer_fp8, hadamard=self.h_mat, dtype=dt,
                                     scale_fmt=self.num.act_scale_fmt)
        return {"q": q, "index_q": qi, "index_w": wi}

    def select(self, e: Env, b: Env) -> torch.Tensor:
        a = self.cfg.attn
        n = b["block_tables"].shape[1] * a.block_size
        scores = self.indexer_logits(e, b, self.index_cache, self.index_fmt, n)
        return K.topk_visible(scores, b["positions"] + 1, a.index_topk)

    def attend(self, e: Env, topk: torch.Tensor, b: Env) -> torch.Tensor:
        """Sparse MQA in latent space, then W_UV (vLLM: FlashMLA sparse + the W_UV bmm)."""
        a, bt = self.cfg.attn, b["block_tables"]
        topk = topk[:, : min(topk.shape[1], bt.shape[1] * a.block_size)].to(torch.int64)
        slots = K.global_slots(bt, b["req_idx"], topk, a.block_size)
        rows = K.read_records(self.kv_cache, self.kv_fmt, slots)
        o_lat = K.sparse_mqa(e["q"], rows, topk >= 0, scale=a.softmax_scale, v_dim=a.kv_lora_rank).to(self.dt)
        o = K.per_head("thc,hdc->thd", o_lat, self.w_uv, self.dt)
        return o.reshape(o.shape[0], -1)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.lin(o, "attn.wo", self.dt)


class V4Layer(_Layer):
    """V4: window + compressed KV (C4 with indexer, C128), attention sink, grouped output projection."""

    def __init__(self, cfg: Any, p: dict[str, torch.Tensor], i: int, num_blocks: int, device: torch.device,
                 indexer_kernel: str = "torch", out_features: dict[str, int] | None = None):
        super().__init__(cfg, p, f"layers.{i}.", device, indexer_kernel, out_features)
        from jds.ops import compressor as comp
        from jds.ops.rope import cached_inv_freqs

        a = cfg.attn
        self.ratio = int(a.compress_ratios[i])
        self.fmts = v4_formats(cfg, self.ratio)
        self.store = {k: K.new_storage(f, num_blocks, device) for k, f in self.fmts.items()}
        self.inv_freqs = torch.from_numpy(cached_inv_freqs(a.rope_for(self.ratio), a.rope_head_dim).copy()).to(device)
        self.c = comp.overlap_factor(self.ratio) if self.ratio else 0
        self.split = a.q_lora_rank  # the q latent's rows, then kv's (an FP8 weight may have zero rows after)

    def caches(self) -> dict[str, torch.Tensor]:
        return dict(self.store)

    def project_in(self, x: torch.Tensor) -> Env:
        x = x.to(self.dt)
        y = self.lin(x, "attn.wq_a_wkv", self.dt)
        out = {"q_lat": y[:, : self.split], "kv": y[:, self.split:]}
        if self.ratio:
            out["comp"] = self.lin(x.to(K.F32), "attn.compressor.wkv_wgate", K.F32)
        if self.ratio == 4:
            out["index_comp"] = self.lin(x.to(K.F32), "attn.indexer.compressor.wkv_wgate", K.F32)
            out["index_w"] = self.lin(x.to(K.F32), "attn.indexer.weights_proj", K.F32)
        return out

    def _compress(self, pre: str, state_key: str, proj: torch.Tensor, d: int, ratio: int, b: Env
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        from jds.ops.compressor import max_closing

        a = self.cfg.attn
        t, r = b["positions"].shape[0], b["block_tables"].shape[0]
        return K.compress(self.store[state_key], self.fmts[state_key], proj, self.w[pre + "ape"],
                          positions=b["positions"], req_idx=b["req_idx"], slot_mapping=b["slot_mapping"],
                          block_tables=b["block_tables"], ratio=ratio, d=d, block_size=a.block_size,
                          norm_weight=self.w[pre + "norm.weight"], eps=self.eps, inv_freqs=self.inv_freqs,
                          rope_dim=a.rope_head_dim, dtype=self.dt, max_out=max_closing(t, r, ratio))

    def prepare(self, e: Env, b: Env) -> Env:
        a, w, dt, rd = self.cfg.attn, self.w, self.dt, self.cfg.attn.rope_head_dim
        cos, sin = K.rope_cos_sin(self.inv_freqs, b["positions"])
        qr = K.rms_norm(e["q_lat"], w["attn.q_norm.weight"], self.eps, dt)
        q = self.lin(qr, "attn.wq_b", dt).reshape(-1, a.n_heads, a.head_dim)
        q = K.rms_norm(q, None, self.eps, dt)
        q = K.rope_part(q, cos, sin, rope_dim=rd, first=False, interleaved=True)
        k = K.rope_part(K.rms_norm(e["kv"], w["attn.kv_norm.weight"], self.eps, dt), cos, sin, rope_dim=rd,
                        first=False, interleaved=True)
        K.write_records(self.store["window"], self.fmts["window"], b["slot_mapping"], k)
        out = {"q": q}
        if self.ratio:
            ent, slots = self._compress("attn.compressor.", "state", e["comp"], a.head_dim, self.ratio, b)
            K.write_records(self.store["compressed"], self.fmts["compressed"], slots, ent)
        if self.ratio == 4:
            ent, slots = self._compress("attn.indexer.compressor.", "index_state", e["index_comp"],
                                        a.index_head_dim, 4, b)
            ent = ent.to(dt)
            if self.h_mat is not None:
                ent = K.hadamard_rotate(ent, self.h_mat)
            K.write_records(self.store["index_k"], self.fmts["index_k"], slots, ent)
            qi = self.lin(qr, "attn.indexer.wq_b", dt).reshape(-1, a.index_n_heads, a.index_head_dim)
            qi = K.rope_part(qi, cos, sin, rope_dim=rd, first=False, interleaved=True)
            out["index_q"], out["index_w"] = K.prepare_indexer_q(
                qi, e["index_w"], head_dim=a.index_head_dim, n_heads=a.index_n_heads, fp8=self.num.indexer_fp8,
                hadamard=self.h_mat, dtype=dt)
        return out

    def _max_entries(self, b: Env) -> int:
        return b["block_tables"].shape[1] * (self.cfg.attn.block_size // self.ratio)

    def select(self, e: Env, b: Env) -> torch.Tensor:
        t = b["positions"].shape[0]
        if self.ratio != 4:
            return torch.zeros((t, 0), dtype=torch.int32, device=b["positions"].device)
        scores = self.indexer_logits(e, b, self.store["index_k"], self.fmts["index_k"], self._max_entries(b))
        return K.topk_visible(scores, torch.div(b["positions"] + 1, 4, rounding_mode="floor"), self.cfg.attn.index_topk)

    def attend(self, e: Env, topk: torch.Tensor, b: Env) -> torch.Tensor:
        """One sparse MQA over [window | compressed] with the sink, then the inverse RoPE at p
        (vLLM: FlashMLA sparse with the sink, the inverse RoPE fused into o_proj)."""
        a, p, bt, req = self.cfg.attn, b["positions"], b["block_tables"], b["req_idx"]
        w_local = p[:, None] - a.window_size + 1 + torch.arange(a.window_size, device=p.device)
        w_local = torch.where(w_local >= 0, w_local, torch.full_like(w_local, -1))
        rows = [K.read_records(self.store["window"], self.fmts["window"],
                               K.global_slots(bt, req, w_local, a.block_size))]
        valid = [w_local >= 0]
        if self.ratio:
            n = self._max_entries(b)
            if self.ratio == 4:
                c_local = topk[:, : min(topk.shape[1], n)].to(torch.int64)
            else:
                c_local = torch.arange(n, device=p.device).expand(p.shape[0], n)
                lim = torch.div(p + 1, self.ratio, rounding_mode="floor")[:, None]
                c_local = torch.where(c_local < lim, c_local, torch.full_like(c_local, -1))
            rows.append(K.read_records(self.store["compressed"], self.fmts["compressed"],
                                       K.global_slots(bt, req, c_local, a.block_size // self.ratio)))
            valid.append(c_local >= 0)
        o = K.sparse_mqa(e["q"], torch.cat(rows, 1), torch.cat(valid, 1), scale=a.softmax_scale,
                         v_dim=a.head_dim, sink=self.w["attn.attn_sink"]).to(self.dt)
        cos, sin = K.rope_cos_sin(self.inv_freqs, p)
        o = K.rope_part(o, cos, sin, rope_dim=a.rope_head_dim, first=False, interleaved=True, inverse=True)
        return o.reshape(o.shape[0], -1)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        a = self.cfg.attn
        og = o.reshape(o.shape[0], a.o_groups, (a.n_heads // a.o_groups) * a.head_dim)
        wa = self.w["attn.wo_a.weight"]
        wg = wa.reshape(a.o_groups, wa.shape[0] // a.o_groups, wa.shape[1])
        if self.dt == K.F32:
            z = torch.einsum("tgi,goi->tgo", og, wg)
        else:  # bf16 batched GEMM (fp32 accumulation), one rounding
            z = torch.bmm(og.to(wg.dtype).transpose(0, 1), wg.transpose(1, 2)).transpose(0, 1)
        return self.lin(z.reshape(z.shape[0], -1), "attn.wo_b", self.dt)


def _jdt(name: str) -> Any:
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def v32_formats(cfg: Any) -> tuple[Any, Any]:
    """(MLA cache, indexer cache) record formats of a V3.2 layer, as jds.v32.V32Attention picks them."""
    from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord656

    a, n = cfg.attn, cfg.numerics
    kv = (MlaRecord656(a.block_size, n.latent_scale_fmt, a.kv_lora_rank, a.qk_rope_head_dim)
          if n.kv_cache_dtype == "fp8" else FloatRows(a.kv_record_dim, a.block_size, _jdt(n.kv_cache_dtype)))
    idx = (IndexerRecord132(a.block_size, a.index_head_dim, scale_fmt=n.act_scale_fmt) if n.indexer_fp8
           else FloatRows(a.index_head_dim, a.block_size, _jdt(n.dtype)))
    return kv, idx


def v4_formats(cfg: Any, ratio: int) -> dict[str, Any]:
    """Record format of each cache a V4 layer of ``ratio`` has, as jds.v4.V4Attention picks them."""
    from jds.ops.compressor import state_format
    from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584

    a, n = cfg.attn, cfg.numerics

    def kv(epp: int) -> Any:
        if n.kv_cache_dtype == "fp8":
            return MlaRecord584(epp, a.head_dim - a.rope_head_dim, a.rope_head_dim, a.quant_block)
        return FloatRows(a.head_dim, epp, _jdt(n.kv_cache_dtype))

    fmts = {"window": kv(a.block_size)}
    if ratio:
        fmts.update(compressed=kv(a.block_size // ratio), state=state_format(ratio, a.head_dim, a.block_size))
    if ratio == 4:
        epp = a.block_size // 4
        fmts.update(index_k=IndexerRecord132(epp, a.index_head_dim) if n.indexer_fp8
                    else FloatRows(a.index_head_dim, epp, _jdt(n.dtype)),
                    index_state=state_format(4, a.index_head_dim, a.block_size))
    return fmts


class TorchDecoder:
    """embedding -> L x [RMSNorm -> attention -> RMSNorm -> FFN] -> RMSNorm -> lm_head, over its own
    paged caches of ``num_blocks`` pages per cache."""

    def __init__(self, cfg: Any, params: dict[str, torch.Tensor], num_blocks: int,
                 device: torch.device | str = "cpu", indexer_kernel: str = "torch",
                 out_features: dict[str, int] | None = None):
        """``indexer_kernel``: "torch" (torch ops) or "triton" (jds.compare.triton_kernels, FP8 caches).
        ``out_features``: the out features of FP8 linears stored with zero rows past them (``fp8_out_features``),
        whose outputs are cut there as jds's ``Linear`` cuts them."""
        self.cfg, self.device, self.num_blocks = cfg, torch.device(device), num_blocks
        self.params = {k: v.to(self.device) for k, v in params.items()}
        layer = V32Layer if cfg.arch == "v32" else V4Layer
        self.layers = [layer(cfg, self.params, i, num_blocks, self.device, indexer_kernel, out_features or {})
                       for i in range(cfg.n_layers)]
        self.eps = cfg.attn.rms_norm_eps
        self.dt = K.torch_dtype(cfg.numerics.dtype)

    @classmethod
    def from_jds(cls, model: Any, num_blocks: int, device: torch.device | str = "cpu",
                 indexer_kernel: str = "torch") -> "TorchDecoder":
        return cls(model.cfg, params_to_torch(model, device), num_blocks, device, indexer_kernel,
                   fp8_out_features(model))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.params["embed.weight"][tokens]

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        x = K.rms_norm(h[logits_indices], self.params["head.norm.weight"], self.eps)
        return K.linear(x, self.params["head.lm_head.weight"], K.F32)

    def cache_pages(self, i: int) -> dict[str, np.ndarray]:
        """Layer ``i``'s caches as jds lays them out ([num_blocks, page_elems], scratch tail dropped)."""
        layer, out = self.layers[i], {}
        fmts = layer.fmts if self.cfg.arch == "v4" else {"kv": layer.kv_fmt, "index_k": layer.index_fmt}
        for name, st in layer.caches().items():
            out[name] = torch_to_numpy(st[: self.num_blocks * fmts[name].page_elems].view(self.num_blocks, -1))
        return out

    # The step as a list of named pieces; the runner groups them into graph / eager segments.
    def pieces(self) -> list[tuple[str, Callable[[Env], Env]]]:
        def inputs(env: Env) -> Env:
            return {"tokens": env["in.tokens"].long(), "positions": env["in.positions"].long(),
                    "req_idx": env["in.req_idx"].long(), "slot_mapping": env["in.slot_mapping"].long(),
                    "block_tables": env["in.block_tables"].long(),
                    "logits_indices": env["in.logits_indices"].long()}

        def embed(env: Env) -> Env:
            return {"h": self.embed(env["tokens"])}

        out: list[tuple[str, Callable[[Env], Env]]] = [("producer", inputs), ("producer", embed)]
        for i, layer in enumerate(self.layers):
            out += _layer_pieces(i, layer)
        out.append(("producer", lambda env: {"logits": self.head(env["h"], env["logits_indices"])}))
        return out


def _batch(env: Env) -> Env:
    return {k: env[k] for k in ("positions", "req_idx", "slot_mapping", "block_tables")}


def _pick(env: Env, pre: str) -> Env:
    return {k[len(pre):]: env[k] for k in list(env.keys()) if k.startswith(pre)}


def _layer_pieces(i: int, layer: Any) -> list[tuple[str, Callable[[Env], Env]]]:
    """(role, fn) per stage: role ``producer`` (in graphs from ``narrow`` on), ``insert`` (the cache
    producers: in graphs in ``narrow`` but inside the attention op in ``wide``), ``consumer`` (indexer +
    sparse MQA + W_UV: eager in ``wide`` and ``narrow``)."""
    q = f"L{i}.q."

    def pre(env: Env) -> Env:
        return {f"L{i}.in.{k}": v for k, v in layer.pre_attention(env["h"]).items()}

    def prep(env: Env) -> Env:
        return {q + k: v for k, v in layer.prepare(_pick(env, f"L{i}.in."), _batch(env)).items()}

    def sel(env: Env) -> Env:
        return {f"L{i}.topk": layer.select(_pick(env, q), _batch(env))}

    def att(env: Env) -> Env:
        return {f"L{i}.o": layer.attend(_pick(env, q), env[f"L{i}.topk"], _batch(env))}

    def post(env: Env) -> Env:
        return {"h": layer.post_attention(env["h"], env[f"L{i}.o"])}

    return [("producer", pre), ("insert", prep), ("consumer", sel), ("consumer", att), ("producer", post)]


# ----- launch counting -----------------------------------------------------------------------------
class OpCounter:
    """Counts the aten ops dispatched while active (a TorchDispatchMode), split into kernel-launching
    ops and pure view/metadata ops. A CUDA-graph replay dispatches no aten op, so inside a runner step it
    counts exactly what runs outside graphs."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                if counter.active:
                    if getattr(func, "is_view", False) or func.__name__.split(".")[0] in _METADATA_OPS:
                        counter.views += 1
                    else:
                        counter.launches += 1
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()
        self.active = False
        self.launches = 0
        self.views = 0


_METADATA_OPS = {"detach", "alias", "lift_fresh", "_to_copy_meta", "empty", "empty_strided", "sym_size",
                 "sym_stride", "sym_numel", "is_same_size"}


# ----- the runner ----------------------------------------------------------------------------------
@dataclass
class _Segment:
    graphed: bool
    fns: list[Callable[[Env], Env]]
    graph: Any = None
    static_in: Env | None = None
    static_out: Env | None = None

    def run(self, env: Env) -> None:
        for f in self.fns:
            env.update(f(env))


class _ReadTracker(dict):
    """A dict that records the keys read from it (finds a segment's graph inputs)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.reads: set[str] = set()

    def __getitem__(self, k: str) -> Any:
        self.reads.add(k)
        return super().__getitem__(k)


class TorchStepRunner:
    """Runs ``TorchDecoder`` steps in one boundary mode; graphs are captured once per step shape
    (tokens, request rows, block-table columns) on a CUDA device and replayed after."""

    def __init__(self, model: TorchDecoder, mode: str):
        if mode not in TORCH_MODES:
            raise ValueError(f"mode must be one of {TORCH_MODES}, got {mode!r}")
        self.model, self.mode = model, mode
        self.device = model.device
        self.use_graphs = self.device.type == "cuda" and mode != "eager"
        self._shapes: dict[tuple[int, int, int], tuple[StepInputs, list[_Segment], Any]] = {}
        self.counter: OpCounter | None = None
        self.last_counts: dict[str, int] = {}
        self.last_env: Env = {}

    def segments(self) -> list[_Segment]:
        """The pieces grouped by the mode's boundary."""
        eager_roles = {"eager": {"producer", "insert", "consumer"}, "wide": {"insert", "consumer"},
                       "narrow": {"consumer"}, "full": set()}[self.mode]
        segs: list[_Segment] = []
        for role, fn in self.model.pieces():
            graphed = role not in eager_roles
            if segs and segs[-1].graphed == graphed:
                segs[-1].fns.append(fn)
            else:
                segs.append(_Segment(graphed, [fn]))
        return segs

    def prepare_inputs(self, ids: np.ndarray, chunks: Sequence[Any], block_tables: np.ndarray
                       ) -> tuple[int, int, int]:
        """Host buffer -> the shape's static device buffer (one copy); returns the shape key."""
        buf, key = host_step(ids, chunks, block_tables, self.model.cfg.block_size)
        if key not in self._shapes:
            self._shapes[key] = (StepInputs.alloc(*key, device=self.device), self.segments(), None)
        inp = self._shapes[key][0]
        inp.host.numpy()[:] = buf
        inp.buf.copy_(inp.host, non_blocking=True)
        return key

    def step(self, key: tuple[int, int, int]) -> torch.Tensor:
        """One step over the inputs of ``prepare_inputs``: logits [R, vocab] fp32 (on the device)."""
        inp, segs, pool = self._shapes[key]
        env: Env = {"in.tokens": inp.tokens, "in.positions": inp.positions, "in.req_idx": inp.req_idx,
                    "in.slot_mapping": inp.slot_mapping, "in.logits_indices": inp.logits_indices,
                    "in.block_tables": inp.block_tables}
        self.last_env = env  # the step's named intermediates (e.g. ``L0.topk``), for tests
        if self.use_graphs and any(s.graphed and s.graph is None for s in segs):
            self._capture(key, env)
            return env["logits"]
        for s in segs:
            if s.graphed and s.graph is not None:
                for k, t in s.static_in.items():
                    if env[k] is not t:
                        self._count(lambda: t.copy_(env[k]))
                s.graph.replay()
                env.update(s.static_out)
            elif s.graphed:
                s.run(env)  # off-CUDA fallback: the graph's ops, eagerly, not counted as out-of-graph
            else:
                self._count(lambda: s.run(env))
        return env["logits"]

    def _count(self, fn: Callable[[], Any]) -> Any:
        c = self.counter
        if c is None:
            return fn()
        c.active = True
        try:
            return fn()
        finally:
            c.active = False

    def _capture(self, key: tuple[int, int, int], env: Env) -> None:
        """Warm each graph segment eagerly, capture it over static copies of its inputs, replay it; run
        eager segments as they come (their outputs feed the next capture)."""
        inp, segs, pool = self._shapes[key]
        pool = torch.cuda.graph_pool_handle()
        persistent = {id(t) for t in env.values()}
        for s in segs:
            if not s.graphed:
                s.run(env)
                continue
            tracker = _ReadTracker(env)
            side = torch.cuda.Stream(self.device)  # warm-up on a side stream, as torch.cuda.graph's recipe
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                s.run(tracker)  # also fills the caches as the replay will, with the same bytes
            torch.cuda.current_stream(self.device).wait_stream(side)
            reads = {k for k in tracker.reads if k in env}
            s.static_in = {k: env[k] if id(env[k]) in persistent else env[k].clone() for k in reads}
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            # thread_local: jax's runtime threads in the same process may touch CUDA during the capture
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                cap: Env = dict(s.static_in)
                for f in s.fns:
                    cap.update(f(cap))
            s.graph = g
            # what the segment produced, including keys it read and then replaced (the residual ``h``)
            s.static_out = {k: v for k, v in cap.items() if s.static_in.get(k) is not v}
            persistent |= {id(t) for t in s.static_out.values()}
            g.replay()
            env.update(s.static_out)
        self._shapes[key] = (inp, segs, pool)

    def count_step(self, key: tuple[int, int, int]) -> dict[str, int]:
        """Run one step with the op counter on: aten ops dispatched outside graphs (``launches``: kernel
        ops; ``views``: metadata-only ops). Off CUDA the graph segments' ops are excluded as they would
        be replays."""
        if self.counter is None:
            self.counter = OpCounter()
        c = self.counter
        c.launches = c.views = 0
        with c.mode:
            self.step(key)
        self.last_counts = {"launches": c.launches, "views": c.views}
        return dict(self.last_counts)

    def execute(self, ids: np.ndarray, chunks: Sequence[Any], block_tables: np.ndarray) -> torch.Tensor:
        return self.step(self.prepare_inputs(ids, chunks, block_tables))
