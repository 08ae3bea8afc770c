"""Every configuration of the project: attention (V3.2, V4), numerics, the decoder model and its presets,
and the step runner's settings.

Pure Python (no JAX import) so the PyTorch reference, the checkpoint reader and the server can read it too.
Every config is a frozen dataclass that validates itself in ``__post_init__`` and raises ``ValueError``
naming the offending field, because a wrong head size silently produces garbage otherwise. Settings reach
the library only through these objects, passed down constructors: the library reads no environment
variables (the command-line layer, ``scripts/`` and ``jds.bench``, turns flags into configs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

DType = Literal["float32", "bfloat16"]
KVCacheDType = Literal["fp8", "bfloat16", "float32"]


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"invalid config field {name!r}: {msg}")


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, n, f"must be a positive int, got {v!r}")


def _hf_mapping(d: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """The first of ``keys`` config.json sets (``{}`` when none): a JSON object, else a ValueError naming it."""
    for k in keys:
        v = d.get(k)
        if v:
            _require(isinstance(v, dict), k, f"expected a JSON object, got {v!r}")
            return v
    return {}


def _hf_float(d: Mapping[str, Any], key: str, default: float, where: str = "") -> float:
    """``d[key]`` (``default`` when absent) as a float; a non-number is a ValueError naming ``where + key``."""
    v = d.get(key, default)
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError
        return float(v)
    except ValueError:
        raise ValueError(f"invalid config field {where + key!r}: expected a number, got {v!r}") from None


def _config_int(v: Any, field: str) -> int:
    """A config.json value as an int (an integral float or a numeric string is taken); anything else is a
    ValueError naming ``field``."""
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError
        f = float(v)
        if not f.is_integer():
            raise ValueError
        return int(f)
    except (ValueError, OverflowError):
        raise ValueError(f"invalid config field {field!r}: expected an integer, got {v!r}") from None


def _hf_int(d: Mapping[str, Any], key: str, default: int, where: str = "") -> int:
    """``d[key]`` (``default`` when absent) as an int (``_config_int``, naming ``where + key``)."""
    return _config_int(d.get(key, default), where + key)


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
    # Activation scales of the FP8 linears and of the indexer's q / k quantisation: a checkpoint's
    # ``quantization_config.scale_fmt`` ("ue8m0": power-of-two scales; absent: DeepSeek's plain amax/448)
    act_scale_fmt: Literal["ue8m0", "amax"] = "ue8m0"
    # DeepSeek-V4's grouped ``wo_a``: the release dequantises its FP8 weight at conversion and runs a plain bf16
    # einsum (no activation quantisation); True keeps it an FP8 linear like the others (a departure)
    wo_a_fp8: bool = False
    # DeepSeek-V4's C4 indexer as released: q and compressed keys through MXFP4 (e2m1, 32-element blocks,
    # power-of-two scales; 68-byte key records) instead of e4m3 per 128. Off by default until the Pallas
    # indexer kernel reads FP4 records (with it on, ``implementation="auto"`` scores in XLA). V4 only. The
    # scores stay fp32; the release's bf16 score einsum and bf16 weights_proj are not modelled (issue 22).
    indexer_fp4: bool = False
    # DeepSeek-V4's routed experts as released: w1/w2/w3 held as packed e2m1 (two codes a byte, uint8
    # [E, out, in/2]) with one e8m0 exponent byte per 1x32 block (uint8 [E, out, in/32]), dequantised inside the
    # step (XLA), the experts' inputs re-quantised to e4m3 per 128 with ue8m0 scales as the release's
    # ``linear()`` does before its FP4 GEMM. V4 block only; hidden_size and moe_intermediate_size multiples of
    # 128. Off: bf16 experts without activation quantisation (the random presets; an FP4 release imports with
    # it on). The shared expert is not affected.
    experts_fp4: bool = False
    # DeepSeek-V3 / V3.2 routed experts as an FP8 checkpoint stores them: e4m3 [E, out, in] with float32 128 x 128
    # block scales, multiplied by the grouped FP8 GEMM with the experts' inputs re-quantised per 128
    # (``act_scale_fmt``), as DeepSeek's ``linear()`` does. V3-style block only; hidden_size and
    # moe_intermediate_size multiples of 128. An FP8 V3.2 checkpoint whose experts are stored e4m3 imports with it
    # on (jds.hf_import); off: the experts dequantised to the activation dtype at import.
    experts_fp8: bool = False
    # DeepSeek-V4's compressor projections (each compressor's wkv and wgate, fp32 output): held in float32 and
    # multiplied in float32 (on the GPU's CUDA cores). Off: held in the activation dtype, as vLLM holds them,
    # and multiplied with fp32 accumulation (bf16: the tensor cores). A checkpoint that stores them F32 imports with
    # it on (jds.hf_import); with float32 activations they are float32 either way.
    compressor_float32: bool = False
    # The indexer's weights_proj (x -> per-head weights, fp32 output): held in float32 and multiplied in float32 (on
    # the GPU's CUDA cores, one CTA for a decode batch's 64 x 64 output). Off: held in the activation dtype as the
    # checkpoints store it (bf16) and multiplied with fp32 accumulation, which gives the float32 products of those
    # values exactly (bf16 x bf16 fits float32), so only the summation order differs from DeepSeek's fp32 GEMM. A
    # checkpoint that stores it F32 imports with it on (jds.hf_import); with float32 activations it is float32 anyway.
    weights_proj_float32: bool = False

    def __post_init__(self) -> None:
        _require(self.dtype in ("float32", "bfloat16"), "dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        _require(
            self.kv_cache_dtype in ("fp8", "bfloat16", "float32"),
            "kv_cache_dtype",
            f"must be fp8, bfloat16 or float32, got {self.kv_cache_dtype!r}",
        )
        _require(self.latent_scale_fmt in ("ue8m0", "amax"), "latent_scale_fmt", "must be ue8m0 or amax")
        _require(self.act_scale_fmt in ("ue8m0", "amax"), "act_scale_fmt", "must be ue8m0 or amax")
        _require(isinstance(self.experts_fp4, bool), "experts_fp4", f"must be a bool, got {self.experts_fp4!r}")
        _require(isinstance(self.experts_fp8, bool), "experts_fp8", f"must be a bool, got {self.experts_fp8!r}")
        _require(isinstance(self.compressor_float32, bool), "compressor_float32",
                 f"must be a bool, got {self.compressor_float32!r}")
        _require(isinstance(self.weights_proj_float32, bool), "weights_proj_float32",
                 f"must be a bool, got {self.weights_proj_float32!r}")

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
        rs = _hf_mapping(d, "rope_scaling", "rope_parameters")
        where = "rope_scaling." if d.get("rope_scaling") else "rope_parameters."
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        interleave = d.get("indexer_rope_interleave", False)
        _require(interleave is None or isinstance(interleave, bool), "indexer_rope_interleave",
                 f"expected true or false, got {interleave!r}")
        kw: dict[str, Any] = dict(
            hidden_size=d.get("hidden_size"), n_heads=d.get("num_attention_heads"),
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d.get("kv_lora_rank"),
            qk_nope_head_dim=d.get("qk_nope_head_dim"), qk_rope_head_dim=d.get("qk_rope_head_dim"),
            v_head_dim=d.get("v_head_dim"), index_n_heads=d.get("index_n_heads"),
            index_head_dim=d.get("index_head_dim"), index_topk=d.get("index_topk"),
            rope_theta=_hf_float(d, "rope_theta", rs.get("rope_theta", 10000.0)),
            max_seq_len=d.get("max_position_embeddings"), rms_norm_eps=_hf_float(d, "rms_norm_eps", 1e-6),
            indexer_rope_interleave=bool(interleave),
        )
        if rope_type == "default":
            kw["rope_factor"] = 1.0
        else:
            kw.update(rope_factor=_hf_float(rs, "factor", 40.0, where),
                      original_seq_len=_hf_int(rs, "original_max_position_embeddings", 4096, where),
                      beta_fast=_hf_float(rs, "beta_fast", 32.0, where),
                      beta_slow=_hf_float(rs, "beta_slow", 1.0, where), mscale=_hf_float(rs, "mscale", 1.0, where))
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
        rs = _hf_mapping(d, "rope_scaling")
        kw: dict[str, Any] = dict(
            hidden_size=d.get("hidden_size"), n_heads=d.get("num_attention_heads"), head_dim=d.get("head_dim"),
            rope_head_dim=d.get("qk_rope_head_dim"), q_lora_rank=d.get("q_lora_rank"),
            o_lora_rank=d.get("o_lora_rank"), o_groups=d.get("o_groups"), window_size=d.get("sliding_window"),
            index_n_heads=d.get("index_n_heads"), index_head_dim=d.get("index_head_dim"),
            index_topk=d.get("index_topk"), rope_theta=_hf_float(d, "rope_theta", 10000.0),
            compress_rope_theta=_hf_float(d, "compress_rope_theta", 160000.0),
            max_seq_len=d.get("max_position_embeddings"), rms_norm_eps=_hf_float(d, "rms_norm_eps", 1e-6),
        )
        ratios = d.get("compress_ratios")
        if ratios is None:
            raise ValueError("invalid config field 'compress_ratios': missing from config.json")
        _require(isinstance(ratios, (list, tuple)), "compress_ratios", f"expected a list of integers, got {ratios!r}")
        kw["compress_ratios"] = tuple(_config_int(r, "compress_ratios") for r in ratios)
        if rs:
            kw.update(rope_factor=_hf_float(rs, "factor", 16.0, "rope_scaling."),
                      original_seq_len=_hf_int(rs, "original_max_position_embeddings", 65536, "rope_scaling."),
                      beta_fast=_hf_float(rs, "beta_fast", 32.0, "rope_scaling."),
                      beta_slow=_hf_float(rs, "beta_slow", 1.0, "rope_scaling."))
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
    try:
        with open(p) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config {p!r}: cannot read it as JSON ({e.strerror if isinstance(e, OSError) else e})") \
            from None
    if not isinstance(d, dict):
        raise ValueError(f"config {p!r}: expected a JSON object, got {type(d).__name__}")
    return d


def replace(cfg: Any, **kw: Any) -> Any:
    """dataclasses.replace that re-runs validation (frozen dataclasses re-validate in __post_init__) and
    names an unknown field in a ValueError instead of a TypeError about ``__init__``."""
    names = {f.name for f in dataclasses.fields(cfg) if f.init}
    for k in kw:
        _require(k in names, k, f"not a field of {type(cfg).__name__}")
    return dataclasses.replace(cfg, **kw)


# ----- the decoder model ------------------------------------------------------------------------------
Arch = Literal["v32", "v4"]
BLOCKS: tuple[str, ...] = ("v3", "v4")
SCORINGS: tuple[str, ...] = ("sqrtsoftplus", "sigmoid", "softmax")  # jds.v4_block.SCORINGS
MOE_IMPLS: tuple[str, ...] = ("ragged", "gather")  # jds.v4_block.MOE_IMPLS


@dataclass(frozen=True)
class ModelConfig:
    """The decoder (jds.model.Decoder): attention of one architecture, layer count, vocabulary and FFN.

    ``n_routed_experts == 0`` is a dense SwiGLU MLP of ``intermediate_size``; otherwise a DeepSeek-style MoE
    of ``n_routed_experts`` experts of width ``moe_intermediate_size``, ``moe_topk`` routed per token, plus
    ``n_shared_experts`` always-on experts. Stored as JSON beside a checkpoint's parameters (``to_dict``).
    """

    arch: Arch
    attn: V32Config | V4Config
    n_layers: int
    vocab_size: int = 512
    intermediate_size: int = 512
    n_routed_experts: int = 0  # 0 = dense SwiGLU MLP
    n_shared_experts: int = 1
    moe_topk: int = 2
    moe_intermediate_size: int = 256
    numerics: Numerics = field(default_factory=Numerics.bf16)
    bos_token_id: int = 256
    eos_token_id: int = 257
    # The decoder block. "v3": one residual stream, RMSNorm -> attention / FFN (the MoE above). "v4": DeepSeek-V4's
    # block (jds.v4_block): hc_mult residual streams mixed by hyper-connections around attention and FFN, the V4
    # MoE (sqrtsoftplus scores, selection bias, route_scale, hash-routed first layers, clamped SwiGLU); arch v4 only.
    block: str = "v3"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    route_scale: float = 1.5
    scoring: str = "sqrtsoftplus"
    n_hash_layers: int = 3
    swiglu_limit: float = 10.0  # 0: no clamp
    shared_swiglu_limit: bool = True  # the shared expert clamped too (the release's later revision)
    moe_impl: str = "ragged"  # V4 MoE: "ragged" grouped GEMMs or "gather" per-token expert weights
    # DeepSeek-V4's multi-token-prediction modules (jds.mtp; HF config.json ``num_nextn_predict_layers``, the release's
    # ModelArgs.n_mtp_layers): 0 = none. MTP module k is a V4 block whose attention kind is
    # compress_ratios[mtp_layer_id(k)] (the release lists the MTP layers' ratios after the main layers'); block v4 only.
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        _require(self.arch in ("v32", "v4"), "arch", f"must be 'v32' or 'v4', got {self.arch!r}")
        want = V32Config if self.arch == "v32" else V4Config
        _require(isinstance(self.attn, want), "attn", f"must be a {want.__name__} for arch {self.arch!r}")
        _require(isinstance(self.numerics, Numerics), "numerics", f"must be a Numerics, got {self.numerics!r}")
        _positive(self, "n_layers", "vocab_size", "intermediate_size")
        if self.arch == "v4":
            _require(self.n_layers <= len(self.attn.compress_ratios), "n_layers",
                     f"exceeds len(compress_ratios)={len(self.attn.compress_ratios)}")
        for n in ("bos_token_id", "eos_token_id", "n_routed_experts"):
            v = getattr(self, n)
            _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, n, f"must be an int >= 0, got {v!r}")
        _require(self.vocab_size > max(self.bos_token_id, self.eos_token_id), "vocab_size",
                 "must exceed the special token ids")
        if self.n_routed_experts:
            _positive(self, "moe_topk", "n_shared_experts", "moe_intermediate_size")
            _require(self.moe_topk <= self.n_routed_experts, "moe_topk",
                     f"must be in [1, n_routed_experts={self.n_routed_experts}], got {self.moe_topk}")
        self._check_block()

    def _check_block(self) -> None:
        """The V4 block's fields (checked whatever ``block`` is, so a stored config never carries junk)."""
        _require(self.block in BLOCKS, "block", f"must be one of {BLOCKS}, got {self.block!r}")
        for n in ("hc_mult", "hc_sinkhorn_iters"):
            _positive(self, n)
        v = self.n_hash_layers
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "n_hash_layers",
                 f"must be an int >= 0, got {v!r}")
        for n, zero_ok in (("hc_eps", True), ("route_scale", False), ("swiglu_limit", True)):
            v = getattr(self, n)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                     and (v > 0 or (zero_ok and v == 0)), n, f"must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                     f"got {v!r}")
        _require(self.scoring in SCORINGS, "scoring", f"must be one of {SCORINGS}, got {self.scoring!r}")
        _require(self.moe_impl in MOE_IMPLS, "moe_impl", f"must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        _require(isinstance(self.shared_swiglu_limit, bool), "shared_swiglu_limit",
                 f"must be a bool, got {self.shared_swiglu_limit!r}")
        if self.numerics.experts_fp4:
            _require(self.block == "v4", "numerics.experts_fp4",
                     f"FP4 routed experts exist in DeepSeek-V4's block only (block 'v4'), got block {self.block!r}")
            for n, v in (("hidden_size", self.hidden_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                _require(v % 128 == 0, n, f"must be a multiple of 128 with numerics.experts_fp4 (the experts' inputs "
                         f"are quantised per 128, the weights per 32), got {v}")
        if self.numerics.experts_fp8:
            _require(self.block == "v3", "numerics.experts_fp8",
                     f"FP8 routed experts are the V3-style block's (block 'v3'), got block {self.block!r}")
            _require(self.n_routed_experts > 0, "numerics.experts_fp8", "needs routed experts (n_routed_experts > 0)")
            for n, v in (("hidden_size", self.hidden_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                _require(v % 128 == 0, n, f"must be a multiple of 128 with numerics.experts_fp8 (128 x 128 weight "
                         f"blocks), got {v}")
        if self.block == "v4":
            _require(self.arch == "v4", "block", f"'v4' needs arch 'v4', got arch {self.arch!r}")
            _require(self.n_routed_experts > 0, "n_routed_experts", "must be > 0 with block 'v4' (every V4 layer is MoE)")
            _require(self.n_shared_experts == 1, "n_shared_experts",
                     f"must be 1 with block 'v4' (one shared expert), got {self.n_shared_experts}")
        m = self.mtp_layers
        _require(isinstance(m, int) and not isinstance(m, bool) and m >= 0, "mtp_layers",
                 f"must be an int >= 0, got {m!r}")
        if m:
            _require(self.block == "v4", "mtp_layers",
                     f"MTP modules exist in DeepSeek-V4's block only (block 'v4'), got block {self.block!r}")
            n_ratios = len(self.attn.compress_ratios)
            _require(n_ratios >= self.n_layers + m, "mtp_layers",
                     f"{m} MTP layers need len(compress_ratios) >= n_layers + mtp_layers = {self.n_layers + m}, got "
                     f"{n_ratios} (the release lists the MTP layers' attention kinds after the main layers')")

    def mtp_layer_id(self, k: int) -> int:
        """The layer id of MTP module ``k`` (its attention kind ``compress_ratios[id]``, its router kind): the release
        builds ``MTPBlock(n_layers + k)`` with ``compress_ratios`` listing n_layers + n_mtp_layers kinds, so the MTP
        kinds are the LAST ``mtp_layers`` entries; counting from the end keeps them right when ``--layers``
        truncates the main stack (the ratios are kept whole)."""
        if not 0 <= k < self.mtp_layers:
            raise ValueError(f"MTP module {k} outside [0, mtp_layers={self.mtp_layers})")
        return len(self.attn.compress_ratios) - self.mtp_layers + k

    @property
    def hidden_size(self) -> int:
        return self.attn.hidden_size

    @property
    def block_size(self) -> int:
        return self.attn.block_size

    @property
    def max_seq_len(self) -> int:
        return self.attn.max_seq_len

    def layer_kind(self, i: int) -> str:
        """Layers of one kind share compiled executables."""
        if self.arch == "v32":
            return "mla"
        return {0: "swa", 4: "c4"}.get(self.attn.compress_ratios[i], "c128")

    # ----- (de)serialisation -----
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (nested dicts, tuples as lists); :meth:`from_dict` inverts it exactly."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: Any) -> "ModelConfig":
        """Inverse of :meth:`to_dict`. A missing, unknown or invalid field is a ValueError naming it (dotted
        for nested fields, e.g. ``attn.index_topk``), so a config from another jds version never loads
        half-understood."""
        _require(isinstance(d, dict), "<config>", f"expected an object, got {type(d).__name__}")
        _require("arch" in d, "arch", "missing")
        attn_cls = {"v32": V32Config, "v4": V4Config}.get(d["arch"]) if isinstance(d["arch"], str) else None
        _require(attn_cls is not None, "arch", f"must be 'v32' or 'v4', got {d['arch']!r}")
        kw = _fields_from_dict(cls, d, "")
        kw["attn"] = attn_cls(**_fields_from_dict(attn_cls, d.get("attn"), "attn"))
        if "numerics" in kw:
            kw["numerics"] = Numerics(**_fields_from_dict(Numerics, kw["numerics"], "numerics"))
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid config: not valid JSON ({e})") from None
        return cls.from_dict(d)


def _fields_from_dict(cls: type, data: Any, where: str) -> dict[str, Any]:
    """Constructor keywords of dataclass ``cls`` from JSON data: every key known, every required one present,
    JSON lists back to tuples."""
    prefix = where + "." if where else ""
    _require(isinstance(data, dict), where or "<config>", f"expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in data:
        _require(k in fields, prefix + k, f"unknown to {cls.__name__} (a config from a newer jds?)")
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        _require(name in data or not required, prefix + name, "missing")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def config_diff(a: Any, b: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    """The first field (dotted path) where two configs differ, with both values; None when equal."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
        for f in dataclasses.fields(a):
            r = config_diff(getattr(a, f.name), getattr(b, f.name), prefix + f.name + ".")
            if r:
                return r
        return None
    return None if a == b else (prefix.rstrip(".") or "<config>", a, b)


PRESETS: tuple[str, ...] = ("v32-tiny", "v4-tiny", "v4-tiny-block", "v32-bench", "v4-bench")


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Named model presets. ``*-tiny`` run on a CPU; ``*-bench`` have the real attention head dims.
    ``overrides`` replace ModelConfig fields (an unknown name is a ValueError)."""
    if name == "v32-tiny":
        cfg = ModelConfig("v32", V32Config.tiny(), n_layers=2)
    elif name == "v4-tiny":
        cfg = ModelConfig("v4", V4Config.tiny(), n_layers=3)
    elif name == "v4-tiny-block":
        # v4-tiny's attention inside DeepSeek-V4's block: 3 layers (window-only, C4, C128), the first hash-routed.
        cfg = ModelConfig("v4", V4Config.tiny(), n_layers=3, block="v4", n_routed_experts=8, moe_topk=2,
                          moe_intermediate_size=64, n_hash_layers=1)
    elif name == "v32-bench":
        # Real V3.2 attention at full hidden size; 8 layers; dense MLP with the MoE expert width.
        cfg = ModelConfig("v32", dataclasses.replace(V32Config(), max_seq_len=16384), n_layers=8, vocab_size=32768,
                          intermediate_size=2048)
    elif name == "v4-bench":
        cfg = ModelConfig("v4", dataclasses.replace(V4Config(), max_seq_len=65536), n_layers=8, vocab_size=32768,
                          intermediate_size=2048)
    else:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    mtp = overrides.get("mtp_layers", 0)
    if isinstance(mtp, int) and mtp > 0 and cfg.arch == "v4" and "attn" not in overrides:
        # the presets list one attention kind per main layer; MTP layers get window-only attention appended, as
        # the released V4 configs' last compress_ratios entry is 0 (the MTP layer's kind)
        need = overrides.get("n_layers", cfg.n_layers) + mtp
        ratios = cfg.attn.compress_ratios
        if isinstance(need, int) and len(ratios) < need:
            overrides = {**overrides, "attn": replace(cfg.attn, compress_ratios=ratios + (0,) * (need - len(ratios)))}
    return replace(cfg, **overrides) if overrides else cfg


def load_model_config(name: str = "v32-tiny", config_path: str | os.PathLike | None = None,
                      **overrides: Any) -> ModelConfig:
    """A preset, optionally with its attention config replaced from a HF ``config.json``, then
    ``overrides`` of ModelConfig fields (e.g. the MoE ones: ``n_routed_experts``, ``moe_topk``,
    ``n_shared_experts``, ``moe_intermediate_size``)."""
    overrides = dict(overrides)
    # the preset appends the MTP layers' attention kinds itself (a later replace() would lack them)
    cfg = preset(name, mtp_layers=overrides.pop("mtp_layers")) if "mtp_layers" in overrides and not config_path \
        else preset(name)
    if config_path:
        attn = (V32Config if cfg.arch == "v32" else V4Config).from_hf_config(config_path)
        cfg = replace(cfg, attn=attn)
    return replace(cfg, **overrides) if overrides else cfg


# ----- the step runner --------------------------------------------------------------------------------
RUNNER_MODES: tuple[str, ...] = ("wide", "narrow", "fused")
INPUT_PREPS: tuple[str, ...] = ("auto", "device", "host")
STEP_BUFFERS: tuple[str, ...] = ("auto", "pinned", "transfer")
CompilerOptions = Mapping[str, "str | bool | int | float"]


@dataclass(frozen=True)
class RunnerConfig:
    """The step runner's settings (``jds.runner.BoundaryRunner`` / ``ModelRunner``); the model's are in
    ``ModelConfig``. Built once at the command line (``scripts/serve.py``) or in a benchmark and passed down.

    Checked here: everything that needs no model. The runner adds the checks that do (``segments`` against
    the layer count, ``max_model_len`` against the model's ``max_seq_len``, key-block buckets against the
    block table's width).

    Compiler options are XLA ``DebugOptions`` fields set per executable (``jax.jit(compiler_options=)``).
    Captured executables get ``captured_compiler_options`` alone (None: XLA's defaults, CUDA graphs on).
    Eager ones get command buffers off on a GPU, then ``eager_compiler_options`` over that. ``dump_dir`` adds
    ``xla_dump_to`` to both, so a dump covers exactly this runner's executables without editing ``XLA_FLAGS``.
    Under both lies ``xla_allow_excess_precision`` = ``excess_precision``: XLA's default (True) lets a fusion
    keep bf16 intermediates in float32, so the jitted bf16 forward skips rounding points that the eager forward
    and DeepSeek's reference make (most of a V4 layer's outputs then differ from eager's; with it off, a few
    by one bf16 ulp: tests/test_excess_precision.py). False, the default here, rounds where the program casts.
    """

    mode: str = "narrow"  # execution boundary: wide / narrow / fused (see jds.runner)
    num_blocks: int = 256  # KV pages in the pool
    max_num_seqs: int = 16  # request rows per step
    max_num_tokens: int = 256  # tokens per step (the largest token bucket)
    max_model_len: int = 1024  # longest sequence, prompt + output
    token_buckets: tuple[int, ...] = ()  # step sizes to compile; () = a x4 ladder; max_num_tokens is added
    key_block_buckets: tuple[int, ...] = ()  # key-block counts to compile; () = a x4 ladder; the maximum is added
    input_prep: str = "auto"  # "device": one packed buffer, batch built in the graph; "host": make_batch
    stable_inputs: bool = False  # host prep: write each step's inputs into persistent device buffers
    update_capacity: int = 0  # block-table entries one packed step may change (0: 4 per row + 64)
    # device prep: how the packed step reaches the executable. "pinned": written in place into a persistent
    # pinned-host buffer that the executable copies itself (no transfer call on the host's critical path);
    # "transfer": a host-to-device transfer per step; "auto": pinned without a device mesh, else transfer
    step_buffer: str = "auto"
    segments: int = 1  # fused + device prep: the step as this many captured executables, launched in order
    # fused segments: layers in the first (0: an even split); the rest split evenly over the others. Only the
    # first segment's launch is on the host's critical path, so a short one lets the device start sooner
    first_segment_layers: int = 0
    compile_workers: int = 4  # fused + device prep: threads compiling the step's executables in warmup
    batch_invariant: bool = False  # one token bucket and one key-block bucket (jds.runner.invariant_buckets)
    all_eager: bool = False  # compile every executable as the eager ones are (command buffers off)
    excess_precision: bool = False  # XLA may keep bf16 intermediates in float32 (its default); False: round as cast
    captured_compiler_options: CompilerOptions | None = None  # XLA options of the captured executables
    eager_compiler_options: CompilerOptions | None = None  # XLA options of the eager executables
    dump_dir: str | None = None  # XLA dump directory for every executable of the runner (xla_dump_to)
    # device mesh (jds.sharding): data x tensor x expert local devices; all 1 = one device, no mesh
    tensor_parallel: int = 1  # attention heads, MLP columns/rows, vocab split over this many devices
    data_parallel: int = 1  # token rows of the dense compute and the KV page pool split this many ways
    expert_parallel: int = 1  # MoE routed experts split over this many devices

    def __post_init__(self) -> None:
        _require(self.mode in RUNNER_MODES, "mode", f"must be one of {RUNNER_MODES}, got {self.mode!r}")
        _require(self.input_prep in INPUT_PREPS, "input_prep", f"must be one of {INPUT_PREPS}, got {self.input_prep!r}")
        _require(self.step_buffer in STEP_BUFFERS, "step_buffer",
                 f"must be one of {STEP_BUFFERS}, got {self.step_buffer!r}")
        _positive(self, "num_blocks", "max_num_seqs", "max_num_tokens", "max_model_len", "segments", "compile_workers")
        for n in ("tensor_parallel", "data_parallel", "expert_parallel"):
            v = getattr(self, n)
            _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, n, f"must be an int >= 1, got {v!r}")
        v = self.update_capacity
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "update_capacity",
                 f"must be an int >= 0, got {v!r}")
        for n in ("stable_inputs", "batch_invariant", "all_eager", "excess_precision"):
            _require(isinstance(getattr(self, n), bool), n, f"must be a bool, got {getattr(self, n)!r}")
        for n, top in (("token_buckets", self.max_num_tokens), ("key_block_buckets", None)):
            given = getattr(self, n)
            _require(isinstance(given, (tuple, list)), n, f"must be a tuple of ints, got {given!r}")
            bad = [b for b in given if isinstance(b, bool) or not isinstance(b, int) or b < 1
                   or (top is not None and b > top)]
            _require(not bad, n, f"{bad} outside [1, {top if top is not None else 'the block table width'}]")
            object.__setattr__(self, n, tuple(given))
        v = self.first_segment_layers
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "first_segment_layers",
                 f"must be an int >= 0, got {v!r}")
        _require(v == 0 or self.segments > 1, "first_segment_layers", "needs segments > 1")
        if self.segments > 1:
            _require(self.mode == "fused" and self.input_prep in ("auto", "device"), "segments",
                     "segments > 1 needs mode='fused' and input_prep='device'")
        for n in ("captured_compiler_options", "eager_compiler_options"):
            opts = getattr(self, n)
            if opts is None:
                continue
            _require(isinstance(opts, Mapping) and all(isinstance(k, str) for k in opts), n,
                     f"must be a mapping of XLA option names to values, got {opts!r}")
            bad = {k: o for k, o in opts.items() if not isinstance(o, (str, bool, int, float))}
            _require(not bad, n, f"option values must be str, bool, int or float, got {bad!r}")
            _require(self.dump_dir is None or "xla_dump_to" not in opts, "dump_dir",
                     f"given twice: as dump_dir and as xla_dump_to in {n}")
            object.__setattr__(self, n, dict(opts))
        _require(self.dump_dir is None or (isinstance(self.dump_dir, str) and self.dump_dir != ""), "dump_dir",
                 f"must be a non-empty path or None, got {self.dump_dir!r}")
