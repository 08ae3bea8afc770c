"""Configuration dataclasses for the DeepSeek-V3.2 and DeepSeek-V4 attention layers.

Pure Python (no JAX import) so the PyTorch reference and the server can read it too.
Every config validates itself in ``__post_init__`` and raises ``ValueError`` naming the
offending field, because a wrong head size silently produces garbage otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

DType = Literal["float32", "bfloat16"]
KVCacheDType = Literal["fp8", "bfloat16", "float32"]


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"invalid config field {name!r}: {msg}")


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, n, f"must be a positive int, got {v!r}")


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN attention-magnitude factor 0.1*mscale*ln(factor)+1 (1 when factor<=1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE table: base theta plus optional YaRN frequency interpolation."""

    theta: float = 10000.0
    yarn: bool = False
    factor: float = 1.0
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        _require(self.theta > 0, "rope_theta", f"must be > 0, got {self.theta}")
        if self.yarn:
            _require(self.factor >= 1.0, "rope_factor", f"YaRN factor must be >= 1, got {self.factor}")
            _require(self.original_seq_len > 0, "original_seq_len", "must be > 0 with YaRN")
            _require(self.beta_fast > self.beta_slow, "beta_fast", "must exceed beta_slow")


@dataclass(frozen=True)
class Numerics:
    """How a layer rounds: activation dtype, cache format and which FP8 emulations are on.

    ``exact()`` is float32 with no quantisation (for 1e-5 parity); ``reference()`` follows
    DeepSeek's [R-fix] reference (bf16 activations, FP8 latent/indexer, fp8 block-scaled linears).
    Scores and softmax are always accumulated in float32 (as FlashMLA does); [R-fix] used bf16.
    """

    dtype: DType = "bfloat16"
    kv_cache_dtype: KVCacheDType = "fp8"
    fp8_linear: bool = False  # weights stored fp8 + 128x128 scales, inputs re-quantised per 128 (ue8m0)
    indexer_fp8: bool = True  # indexer q/k quantised to e4m3 with ue8m0 scales per 128
    indexer_hadamard: bool = True  # DeepSeek reference rotates indexer q/k; vLLM does not
    latent_scale_fmt: Literal["ue8m0", "amax"] = "ue8m0"  # V3.2 656-B record scales: [R-fix] vs vLLM

    def __post_init__(self) -> None:
        _require(self.dtype in ("float32", "bfloat16"), "dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        _require(
            self.kv_cache_dtype in ("fp8", "bfloat16", "float32"),
            "kv_cache_dtype",
            f"must be fp8, bfloat16 or float32, got {self.kv_cache_dtype!r}",
        )
        _require(self.latent_scale_fmt in ("ue8m0", "amax"), "latent_scale_fmt", "must be ue8m0 or amax")

    @classmethod
    def exact(cls) -> "Numerics":
        return cls(dtype="float32", kv_cache_dtype="float32", fp8_linear=False, indexer_fp8=False)

    @classmethod
    def bf16(cls) -> "Numerics":
        return cls(dtype="bfloat16", kv_cache_dtype="bfloat16", fp8_linear=False, indexer_fp8=False)

    @classmethod
    def reference(cls) -> "Numerics":
        return cls(dtype="bfloat16", kv_cache_dtype="fp8", fp8_linear=True, indexer_fp8=True)

    @classmethod
    def serving(cls) -> "Numerics":
        """vLLM-like: bf16 weights, FP8 caches, FP8 indexer, no Hadamard."""
        return cls(dtype="bfloat16", kv_cache_dtype="fp8", fp8_linear=False, indexer_fp8=True, indexer_hadamard=False)


@dataclass(frozen=True)
class V32Config:
    """DeepSeek-V3.2 attention (MLA + lightning indexer). Names follow DeepSeek's inference code."""

    hidden_size: int = 7168
    n_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    max_seq_len: int = 163840
    rms_norm_eps: float = 1e-6
    block_size: int = 64  # tokens per page of the MLA and indexer caches (vLLM CUDA: 64)
    indexer_rope_interleave: bool = False  # True for GLM-5.x; DeepSeek [R-fix] uses NeoX

    def __post_init__(self) -> None:
        _positive(
            self,
            "hidden_size", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "max_seq_len", "block_size",
        )
        _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        _require(self.index_head_dim > self.qk_rope_head_dim, "index_head_dim", "must exceed qk_rope_head_dim")
        for n in ("kv_lora_rank", "index_head_dim", "hidden_size", "q_lora_rank"):
            _require(getattr(self, n) % 128 == 0, n, f"must be a multiple of 128 (FP8 blocks), got {getattr(self, n)}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _require(self.rope_factor >= 1.0, "rope_factor", "must be >= 1")
        RopeConfig(self.rope_theta, self.yarn_active, self.rope_factor, self.original_seq_len, self.beta_fast, self.beta_slow)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_record_dim(self) -> int:
        """Latent plus shared rope key: 576 for the real model."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn_active(self) -> bool:
        # DeepSeek [R]: YaRN (frequencies and mscale) only when max_seq_len > original_seq_len.
        return self.max_seq_len > self.original_seq_len and self.rope_factor > 1.0

    @property
    def rope(self) -> RopeConfig:
        return RopeConfig(self.rope_theta, self.yarn_active, self.rope_factor, self.original_seq_len,
                          self.beta_fast, self.beta_slow)

    @property
    def softmax_scale(self) -> float:
        s = self.qk_head_dim ** -0.5
        if self.yarn_active:
            s *= yarn_mscale(self.rope_factor, self.mscale) ** 2
        return s

    @classmethod
    def deepseek_v32(cls) -> "V32Config":
        return cls()

    @classmethod
    def tiny(cls) -> "V32Config":
        """Real head dims (so cache records are the real 656/132 bytes), few heads, small top-k."""
        return cls(hidden_size=256, n_heads=4, q_lora_rank=256, index_n_heads=4, index_topk=8,
                   rope_factor=4.0, original_seq_len=256, max_seq_len=2048, block_size=16)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> "V32Config":
        """Build from a HuggingFace DeepSeek-V3.2 (or GLM-5.x) ``config.json``."""
        d = _load_json(path_or_dict)
        rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        kw: dict[str, Any] = dict(
            hidden_size=d.get("hidden_size"), n_heads=d.get("num_attention_heads"),
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d.get("kv_lora_rank"),
            qk_nope_head_dim=d.get("qk_nope_head_dim"), qk_rope_head_dim=d.get("qk_rope_head_dim"),
            v_head_dim=d.get("v_head_dim"), index_n_heads=d.get("index_n_heads"),
            index_head_dim=d.get("index_head_dim"), index_topk=d.get("index_topk"),
            rope_theta=float(d.get("rope_theta", rs.get("rope_theta", 10000.0))),
            max_seq_len=d.get("max_position_embeddings"), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            indexer_rope_interleave=bool(d.get("indexer_rope_interleave", False)),
        )
        if rope_type == "default":
            kw["rope_factor"] = 1.0
        else:
            kw.update(rope_factor=float(rs.get("factor", 40.0)),
                      original_seq_len=int(rs.get("original_max_position_embeddings", 4096)),
                      beta_fast=float(rs.get("beta_fast", 32.0)), beta_slow=float(rs.get("beta_slow", 1.0)),
                      mscale=float(rs.get("mscale", 1.0)))
        _check_missing(kw, {"n_heads": "num_attention_heads", "max_seq_len": "max_position_embeddings"})
        kw.update(overrides)
        return cls(**kw)


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4 attention (window + compressed KV + C4 indexer + sink + grouped output projection)."""

    hidden_size: int = 4096
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    window_size: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    compress_ratios: tuple[int, ...] = field(default_factory=lambda: _v4_flash_ratios())
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_seq_len: int = 1048576
    rms_norm_eps: float = 1e-6
    block_size: int = 256  # tokens per logical page shared by all caches of a layer (C4: 64 entries, C128: 2)
    quant_block: int = 64  # NoPE FP8 block of the 584-byte record

    def __post_init__(self) -> None:
        _positive(self, "hidden_size", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_lora_rank",
                  "o_groups", "window_size", "index_n_heads", "index_head_dim", "index_topk", "max_seq_len",
                  "block_size", "quant_block")
        _require(self.rope_head_dim % 2 == 0 and self.rope_head_dim < self.head_dim, "rope_head_dim",
                 "must be even and smaller than head_dim")
        _require(self.n_heads % self.o_groups == 0, "o_groups", f"must divide n_heads={self.n_heads}")
        _require((self.head_dim - self.rope_head_dim) % self.quant_block == 0, "quant_block",
                 "must divide the NoPE width head_dim - rope_head_dim")
        _require(self.index_head_dim > self.rope_head_dim, "index_head_dim", "must exceed rope_head_dim")
        _require(isinstance(self.compress_ratios, tuple) and len(self.compress_ratios) > 0, "compress_ratios",
                 "must be a non-empty tuple")
        for r in self.compress_ratios:
            _require(r in (0, 4, 128) or (r > 1 and self.block_size % r == 0), "compress_ratios",
                     f"ratio {r} must be 0 or divide block_size={self.block_size}")
        for r in self.compress_ratios:
            _require(r == 0 or self.block_size % r == 0, "block_size", f"must be a multiple of every ratio ({r})")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _require(self.compress_rope_theta > 0, "compress_rope_theta", f"must be > 0, got {self.compress_rope_theta}")
        _require(self.rope_factor >= 1.0, "rope_factor", f"must be >= 1, got {self.rope_factor}")
        self.compressed_rope  # validates the YaRN fields

    @property
    def window_rope(self) -> RopeConfig:
        return RopeConfig(theta=self.rope_theta, yarn=False)

    @property
    def compressed_rope(self) -> RopeConfig:
        # Most reference copies gate YaRN on original_seq_len > 0 only (always on).
        return RopeConfig(self.compress_rope_theta, self.original_seq_len > 0 and self.rope_factor > 1.0,
                          self.rope_factor, self.original_seq_len, self.beta_fast, self.beta_slow)

    def rope_for(self, ratio: int) -> RopeConfig:
        return self.window_rope if ratio == 0 else self.compressed_rope

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def n_layers(self) -> int:
        return len(self.compress_ratios)

    @classmethod
    def deepseek_v4_flash(cls) -> "V4Config":
        return cls()

    @classmethod
    def tiny(cls) -> "V4Config":
        """Real head dims (584-byte records), few heads, short window, small top-k."""
        return cls(hidden_size=256, n_heads=4, q_lora_rank=256, o_lora_rank=128, o_groups=2, window_size=16,
                   index_n_heads=4, index_topk=8, compress_ratios=(0, 4, 128), original_seq_len=256,
                   rope_factor=4.0, max_seq_len=4096, block_size=128)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> "V4Config":
        d = _load_json(path_or_dict)
        rs = d.get("rope_scaling") or {}
        kw: dict[str, Any] = dict(
            hidden_size=d.get("hidden_size"), n_heads=d.get("num_attention_heads"), head_dim=d.get("head_dim"),
            rope_head_dim=d.get("qk_rope_head_dim"), q_lora_rank=d.get("q_lora_rank"),
            o_lora_rank=d.get("o_lora_rank"), o_groups=d.get("o_groups"), window_size=d.get("sliding_window"),
            index_n_heads=d.get("index_n_heads"), index_head_dim=d.get("index_head_dim"),
            index_topk=d.get("index_topk"), rope_theta=float(d.get("rope_theta", 10000.0)),
            compress_rope_theta=float(d.get("compress_rope_theta", 160000.0)),
            max_seq_len=d.get("max_position_embeddings"), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        )
        ratios = d.get("compress_ratios")
        if ratios is None:
            raise ValueError("invalid config field 'compress_ratios': missing from config.json")
        kw["compress_ratios"] = tuple(int(r) for r in ratios)
        if rs:
            kw.update(rope_factor=float(rs.get("factor", 16.0)),
                      original_seq_len=int(rs.get("original_max_position_embeddings", 65536)),
                      beta_fast=float(rs.get("beta_fast", 32.0)), beta_slow=float(rs.get("beta_slow", 1.0)))
        else:
            kw["rope_factor"] = 1.0
        _check_missing(kw, {"n_heads": "num_attention_heads", "rope_head_dim": "qk_rope_head_dim",
                            "window_size": "sliding_window", "max_seq_len": "max_position_embeddings"})
        kw.update(overrides)
        return cls(**kw)


def _check_missing(kw: dict[str, Any], hf_keys: dict[str, str]) -> None:
    """Raise naming the first field absent from config.json (and its config.json key when it differs)."""
    missing = [k for k, v in kw.items() if v is None]
    if missing:
        k = missing[0]
        key = f" (key {hf_keys[k]!r})" if k in hf_keys else ""
        raise ValueError(f"invalid config field {k!r}: missing from config.json{key}")


def _v4_flash_ratios() -> tuple[int, ...]:
    # 43 layers + MTP: [0, 0, 4, 128, 4, 128, ..., 4, 0]
    body = [4 if i % 2 == 0 else 128 for i in range(2, 43)]
    return tuple([0, 0] + body + [0])


def _load_json(path_or_dict: str | os.PathLike | dict) -> dict:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    with open(p) as f:
        return json.load(f)


def replace(cfg: Any, **kw: Any) -> Any:
    """dataclasses.replace that re-runs validation (frozen dataclasses re-validate in __post_init__)."""
    return dataclasses.replace(cfg, **kw)
