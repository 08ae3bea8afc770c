"""The step runner: one decoder step split at the execution boundary, in three modes.

  wide    captured: embed / post-attention + FFN + norm + input projections;
          eager per layer: prepare (wq_b, norms, RoPE, cache inserts, indexer prep, compressors) + select + attend
  narrow  captured: everything above plus ``prepare``; eager per layer: select (indexer) + attend (MQA, W_UV)
  fused   the whole step is one executable (static, bucketed shapes)

Captured segments are jitted executables with XLA command buffers (CUDA graphs) on, one per
(layer kind before, layer kind after) pair and token bucket, reused across layers. Eager regions are
separate host dispatches compiled with command buffers *off* (direct launches, like PyTorch eager);
their launch configuration — the number of key blocks they scan — is chosen on the host from this
step's actual sequence lengths. narrow/wide issue L eager + L+1 captured dispatches; fused issues 1.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from flax import nnx

from jds.batch import Chunk, PagedBatch, make_batch, pack_step, replace as replace_batch, step_buffer_len, unpack_step
from jds.config import INPUT_PREPS, RUNNER_MODES, ModelConfig, RunnerConfig, load_model_config, replace  # noqa: F401
from jds.model import Decoder
from jds import sharding
from jds.sampling import greedy_tokens_host, sample_tokens_host, split_seeds

if TYPE_CHECKING:
    from jds.engine.sampling import SamplingRows

Mode = Literal["wide", "narrow", "fused"]
MODES: tuple[str, ...] = RUNNER_MODES


@dataclass(frozen=True)
class StepInputs:
    """A step's inputs under ``input_prep="device"``: one packed int32 buffer (``jds.batch.pack_step``) on
    the device, and the step's static shape buckets (tokens, key blocks)."""

    packed: np.ndarray | jax.Array  # the persistent pinned-host buffer, or numpy / a device array (transfer)
    token_bucket: int
    key_blocks: int
    block_tables: np.ndarray  # the host's tables after this step (the device's copy once it ran)
    prev_tokens: jax.Array | None = None  # the previous step's sampled tokens, for the packed feed
    serial: int = 0  # step_buffer="pinned": which write of the bucket's persistent buffer these inputs are
    source: tuple | None = None  # the caller's block tables as (shape, bytes, any page outside the pool)


_NO_UPDATES = np.zeros(0, np.int64)


def _buckets(lo: int, hi: int, factor: int = 4) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


def _bucket_set(name: str, given: tuple[int, ...], top: int, default: tuple[int, ...]) -> tuple[int, ...]:
    """Sorted compile buckets; ``top`` (the largest step) is always one of them, so every step fits."""
    if not given:
        return default
    bad = [b for b in given if not 1 <= int(b) <= top]
    if bad:
        raise ValueError(f"{name}: {bad} outside [1, {top}]")
    return tuple(sorted({int(b) for b in given} | {top}))


def invariant_buckets(token_buckets: tuple[int, ...], key_block_buckets: tuple[int, ...], max_num_tokens: int,
                      max_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The buckets of batch-invariant mode: only the largest step and the longest block table.

    Why: a token's logits must not depend on what it is batched with, how its prompt was chunked or whether it was
    recomputed after preemption. The decoder has no cross-row reduction: norms, FP8 activation scales (per row, per
    128 columns), RoPE and the cache records are per token, and attention reads each key back from the paged cache
    in prefill and decode alike (a position is written before it is read), so recompute sees the keys that decode
    saw. What remains is the shape: XLA compiles each step shape separately (GEMM algorithms, tilings, fusions), so
    a row can round differently in a 16-token and a 256-token step, and a near-tie greedy or seeded choice flips.
    One token bucket gives every step the same executables, so each row's reduction order is fixed, given that a
    kernel reduces a row the same way at any row index of its shape (true of the CPU backend; the bench's co-batched
    runs check a GPU, where a stream-K GEMM need not; on the H200 they held:
    benchmarks/results/batch_invariant_h200_2026-11-30.json). The key-block bucket is fixed too, so that attention
    and indexer reductions never change width with the step's longest sequence (the CPU backend was found
    insensitive to it; a GPU's reduction tiling need not be). The MoE FFN's ragged_dot groups rows by expert, so its
    per-expert shapes depend on the other rows: invariant on the CPU backend (tests/test_batch_invariant.py), to be
    checked on a GPU (scripts/bench_batch_invariant.py --moe). Costs: every step computes ``max_num_tokens`` rows
    and scans ``max_blocks`` key blocks. Other buckets are refused, not ignored.
    """
    for name, given, top in (("token_buckets", token_buckets, max_num_tokens),
                             ("key_block_buckets", key_block_buckets, max_blocks)):
        if any(int(b) != top for b in given):
            raise ValueError(f"{name}={tuple(given)}: batch_invariant mode uses the single bucket {top}")
    return (max_num_tokens,), (max_blocks,)


def _pick(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class DispatchStats:
    captured: int = 0
    eager: int = 0

    @property
    def total(self) -> int:
        return self.captured + self.eager


class BoundaryRunner:
    """Runs ``Decoder`` steps over paged caches in one boundary mode.

    ``BoundaryRunner(model, RunnerConfig(...))``; keyword settings are RunnerConfig fields replacing the
    config's (``BoundaryRunner(model, mode="fused", num_blocks=24)``), validated alike. The resolved settings
    (``input_prep="auto"`` decided, the buckets completed) are the runner's attributes (``runner.mode``,
    ``runner.token_buckets``, ...); ``runner.config`` gives them back as a RunnerConfig.
    """

    def __init__(self, model: Decoder, config: RunnerConfig | None = None, **settings: Any) -> None:
        config = config if config is not None else RunnerConfig()
        if not isinstance(config, RunnerConfig):
            raise ValueError(f"config must be a RunnerConfig, got {type(config).__name__}")
        if settings:
            config = replace(config, **settings)
        self.model = model
        for f in dataclasses.fields(RunnerConfig):
            setattr(self, f.name, getattr(config, f.name))
        self.last_dispatch = DispatchStats()
        self.__post_init__()

    @classmethod
    def from_config(cls, model: Decoder, config: RunnerConfig) -> "BoundaryRunner":
        return cls(model, config)

    @property
    def config(self) -> RunnerConfig:
        """This runner's settings as resolved at construction (valid input to build another runner)."""
        return RunnerConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunnerConfig)})

    def __post_init__(self) -> None:
        """The checks that need the model (RunnerConfig made the others), then the resolved settings."""
        if self.input_prep == "auto":
            # fused builds the batch inside its one executable; in wide / narrow the batch would leave the
            # first segment as outputs that every later dispatch waits on (measured slower for narrow:
            # benchmarks/results/archive/ttft_v32_h200_2026-11-30.json, narrow:host vs narrow:device)
            self.input_prep = "device" if self.mode == "fused" else "host"
        if not 1 <= self.segments <= self.model.cfg.n_layers:
            raise ValueError(f"segments must be in [1, n_layers={self.model.cfg.n_layers}], got {self.segments}")
        if self.first_segment_layers > self.model.cfg.n_layers - (self.segments - 1):
            raise ValueError(f"first_segment_layers={self.first_segment_layers} leaves fewer than one layer to each of "
                             f"the other {self.segments - 1} segments (n_layers={self.model.cfg.n_layers})")
        cfg = self.model.cfg
        if self.max_model_len > cfg.max_seq_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        self.block_size = cfg.block_size
        self.max_blocks = -(-self.max_model_len // self.block_size)
        if self.batch_invariant:
            self.token_buckets, self.key_block_buckets = invariant_buckets(
                self.token_buckets, self.key_block_buckets, self.max_num_tokens, self.max_blocks)
        self.token_buckets = _bucket_set("token_buckets", self.token_buckets, self.max_num_tokens,
                                         _buckets(min(16, self.max_num_tokens), self.max_num_tokens))
        self.key_block_buckets = _bucket_set("key_block_buckets", self.key_block_buckets, self.max_blocks,
                                             _buckets(min(4, self.max_blocks), self.max_blocks))
        self._place_on_mesh()
        pinned_ok = self.mesh is None and any(m.kind == "pinned_host" for m in self._device.addressable_memories())
        if self.step_buffer == "auto":
            self.step_buffer = "pinned" if pinned_ok else "transfer"
        elif self.step_buffer == "pinned" and not pinned_ok:
            raise ValueError("step_buffer='pinned' needs one device with pinned host memory (no device mesh); "
                             "use 'transfer' or 'auto'")
        # step_buffer="pinned": per token bucket, a persistent pinned-host step buffer and a numpy view of its
        # memory that _pack writes in place; _pinned_serial counts the writes (stale StepInputs are refused)
        self._pinned: dict[int, list[list[Any]]] = {}
        self._pinned_serial: dict[int, int] = {}
        self._marker = jax.jit(lambda x: x[:1, 0])  # a tiny array made after a step (``_witness``)
        # Parameters are flattened to plain leaf lists once: jit's C++ path flattens a list of arrays in
        # microseconds, while an nnx.State pytree costs milliseconds of Python per call.
        self._served = serving_copy(self.model, self.mesh)
        self._embed = _split_flat(self._served.embed)
        self._layers = [_split_flat(layer) for layer in self._served.layers]
        self._head = _split_flat(self._served.head)
        self._whole = _split_flat(self._served)
        self._kinds = [cfg.layer_kind(i) for i in range(cfg.n_layers)]
        self._gd_of_kind = {k: self._layers[i][0] for i, k in reversed(list(enumerate(self._kinds)))}
        self._on_gpu = jax.default_backend() == "gpu"
        self._jits: dict[Any, Callable] = {}
        self._staged: dict[Any, Any] = {}  # (token bucket, key-block bucket) -> persistent step inputs
        self._prev_sampled: jax.Array | None = None  # the last submit's sampled tokens (on the device)
        self._prev_rows = 0
        self._stage_in = jax.jit(  # writes a step's inputs in place into the donated previous ones
            lambda old, new: jax.tree.map(lambda o, n: lax.dynamic_update_slice(o, n, (0,) * o.ndim), old, new),
            donate_argnums=0)
        # Device-side input preparation: the block tables live on the device and each step sends only
        # the entries that changed; ``_bt_host`` mirrors what the device holds.
        self.update_capacity = self.update_capacity or 4 * self.max_num_seqs + 64
        self._bt_host = np.zeros((self.max_num_seqs, self.max_blocks), np.int32)
        self._bt_source: tuple | None = None  # the caller's tables behind _bt_host (StepInputs.source)
        self._bt_state = self._commit(np.zeros((self.max_num_seqs, self.max_blocks), np.int32), replicated=True)
        self._no_prev: jax.Array | None = None
        self._carry: dict[tuple[int, int], tuple] = {}  # segment-boundary buffers per (tokens, key blocks)
        self._logits_out: jax.Array | None = None  # the fused device-prep step's persistent logits buffer
        self._logits_sharding: Any = None  # where a step returns its logits (warmup notes it for warmup_submit)

    # ----- placement on the device mesh -----------------------------------------------------------
    def _place_on_mesh(self) -> None:
        """Build the caches, and with a parallel config (jds.sharding) the mesh, then move the model's
        parameters onto it in place (one copy of the weights, split by the partition rules) and create the
        page pools directly in their sharded layout (no whole-pool copy on one device)."""
        self.mesh = None
        self._cache_sh = self._rows_sh = None
        self._device = jax.devices()[0]
        if not sharding.uses_mesh(self.config):
            self.caches = self._commit(self.model.init_caches(self.num_blocks))
            return
        sharding.check_divisible(self.model.cfg, self.config, self.token_buckets)
        self.mesh = sharding.make_mesh(self.config)
        self._cache_sh, self._rows_sh = sharding.cache_sharding(self.mesh), sharding.rows_sharding(self.mesh)
        state = nnx.state(self.model)
        nnx.update(self.model, jax.device_put(state, sharding.param_shardings(state, self.model.cfg, self.mesh)))
        model, n = self.model, self.num_blocks
        # made by an executable that pins its outputs as the steps do, so the first step sees the layout of
        # the later ones (XLA picks its own for the empty pools of V4 layer kinds whatever the constraint)
        self.caches = jax.jit(lambda: self._pin_caches(model.init_caches(n)))()

    def _commit(self, tree: Any, replicated: bool = False) -> Any:
        """``tree`` placed where the steps keep it: committed to the runner's device, or on a mesh replicated
        (``replicated``) or as it is (the caller placed it).

        Why: jit keys its executables on whether each argument is committed to a device. A buffer made by
        ``jnp.zeros`` is not, while a step's outputs are, so a persistent buffer made uncommitted made the
        first real step after ``warmup`` compile every executable again.
        """
        if self.mesh is None:
            return jax.device_put(tree, self._device)
        return jax.device_put(tree, sharding.replicated(self.mesh)) if replicated else tree

    def _pin_caches(self, caches: Any) -> Any:
        """Inside an executable: keep the returned caches in their placed layout, so a donated pool is
        written in place and the next call sees the shardings it was compiled for."""
        if self._cache_sh is None:
            return caches
        return jax.tree.map(lambda c: lax.with_sharding_constraint(c, self._cache_sh), caches)

    def _pin_whole(self, tree: Any) -> Any:
        """Inside an executable: replicated (step metadata that every device reads whole)."""
        if self.mesh is None:
            return tree
        rep = sharding.replicated(self.mesh)
        return jax.tree.map(lambda x: lax.with_sharding_constraint(x, rep), tree)

    def _pin_rows(self, x: jax.Array) -> jax.Array:
        """Inside an executable: token rows split over the mesh's ``data`` axis (dense compute data parallel)."""
        return x if self._rows_sh is None else lax.with_sharding_constraint(x, self._rows_sh)

    # ----- executables ------------------------------------------------------------------------------
    def _jit(self, key: Any, fn: Callable, *, eager: bool, donate: tuple[int, ...] = (),
             keep_unused: bool = False) -> Callable:
        if key not in self._jits:
            opts = self._compiler_options(eager or self.all_eager)
            self._jits[key] = jax.jit(fn, donate_argnums=donate, compiler_options=opts, keep_unused=keep_unused)
        return self._jits[key]

    def _compiler_options(self, eager: bool) -> dict[str, Any] | None:
        """Per-executable XLA options (RunnerConfig): ``excess_precision`` for all; eager ones run with command
        buffers off on a GPU (direct launches), then ``eager_compiler_options``; captured ones take
        ``captured_compiler_options`` (over XLA's defaults); ``dump_dir`` dumps both kinds."""
        opts: dict[str, Any] = {"xla_allow_excess_precision": self.excess_precision}
        if eager:
            opts.update({"xla_gpu_enable_command_buffer": ""} if self._on_gpu else {})
            opts.update(self.eager_compiler_options or {})
        else:
            opts.update(self.captured_compiler_options or {})
        if self.dump_dir:
            opts["xla_dump_to"] = self.dump_dir
        return opts

    def _first(self, kind: str) -> Callable:
        egd, lgd = self._embed[0], self._gd_of_kind[kind]
        narrow = self.mode == "narrow"

        def first(est, lst, tokens, batch, cache):
            h = _merge(egd, est)(self._pin_rows(tokens))
            x, cache = _producers(_merge(lgd, lst), h, batch, cache, narrow)
            return h, x, self._pin_caches(cache)

        return self._jit(("first", kind), first, eager=False, donate=(4,))

    def _mid(self, prev: str, nxt: str) -> Callable:
        pgd, ngd = self._gd_of_kind[prev], self._gd_of_kind[nxt]
        narrow = self.mode == "narrow"

        def mid(pst, nst, h, o, batch, cache):
            h = self._pin_rows(_merge(pgd, pst).post_attention(h, o))
            x, cache = _producers(_merge(ngd, nst), h, batch, cache, narrow)
            return h, x, self._pin_caches(cache)

        return self._jit(("mid", prev, nxt), mid, eager=False, donate=(5,))

    def _last(self, kind: str) -> Callable:
        pgd, hgd = self._gd_of_kind[kind], self._head[0]

        def last(pst, hst, h, o, logits_indices):
            h = _merge(pgd, pst).post_attention(h, o)
            return _merge(hgd, hst)(h, logits_indices)

        return self._jit(("last", kind), last, eager=False)

    def _eager(self, kind: str) -> Callable:
        gd = self._gd_of_kind[kind]
        if self.mode == "narrow":
            def consume(st, query, batch, cache):
                """Reads the caches only: returns the attention output alone (handing the cache back
                from a call that does not donate it would make XLA copy every page)."""
                return _merge(gd, st).attn.consume(query, batch, cache)[0]
            return self._jit(("eager", kind), consume, eager=True)

        def prepare_and_consume(st, inp, batch, cache):
            attn = _merge(gd, st).attn
            query, cache = attn.prepare(inp, batch, cache)
            return attn.consume(query, batch, cache)[0], self._pin_caches(cache)

        return self._jit(("eager", kind), prepare_and_consume, eager=True, donate=(3,))

    def _fused(self) -> Callable:
        gd = self._whole[0]

        def full(st, tokens, batch, caches, logits_indices):
            logits, caches = _merge(gd, st)(self._pin_rows(tokens), batch, caches, logits_indices)
            return logits, self._pin_caches(caches)

        return self._jit(("fused",), full, eager=False, donate=(3,))

    def _unpack(self, packed: jax.Array, bt_state: jax.Array, kb: int, prev: jax.Array) -> tuple:
        if self.step_buffer == "pinned":  # the copy is a command of the executable, not a host transfer call
            packed = jax.device_put(packed, jax.memory.Space.Device)
        tokens, batch, li, bt = unpack_step(packed, bt_state, num_rows=self.max_num_seqs,
                                            update_capacity=self.update_capacity, block_size=self.block_size,
                                            prev_tokens=prev)
        bt = self._pin_whole(bt)  # the device's block tables stay whole on every device, step after step
        return tokens, batch, li, replace_batch(batch, block_tables=bt[:, :kb]), bt

    def _first_dev(self, kind: str, kb: int) -> Callable:
        egd, lgd = self._embed[0], self._gd_of_kind[kind]
        narrow = self.mode == "narrow"

        def first(est, lst, packed, prev, bt_state, cache):
            tokens, batch, li, small, bt = self._unpack(packed, bt_state, kb, prev)
            h = _merge(egd, est)(self._pin_rows(tokens))
            x, cache = _producers(_merge(lgd, lst), h, batch, cache, narrow)
            return (h, x, self._pin_caches(cache), bt, batch, small, li)

        return self._jit(("first_dev", kind, kb), first, eager=False, donate=(4, 5))

    def _fused_dev(self, kb: int) -> Callable:
        gd = self._whole[0]

        def full(st, packed, prev, bt_state, caches, out):
            tokens, _, li, small, bt = self._unpack(packed, bt_state, kb, prev)
            logits, caches = _merge(gd, st)(self._pin_rows(tokens), small, caches, li)
            return logits, self._pin_caches(caches), bt

        # keep_unused: ``out`` (the last step's logits) is not read, but it must stay an argument so that XLA
        # writes the new logits into its buffer (``_out_buffer``)
        return self._jit(("fused_dev", kb), full, eager=False, donate=(3, 4, 5), keep_unused=True)

    def _out_buffer(self) -> jax.Array | None:
        """The logits buffer a captured step writes in place (donated, so its output aliases it).

        Why: XLA re-records a command buffer when any allocation it uses moved since its last execution, and
        any update makes the launch re-upload the graph. A fresh output allocation lands at a new address
        whenever the previous step's logits are still alive (a caller holding them, or the async engine's
        step in flight): it re-recorded every step (benchmarks/results/archive/
        graph_updates_fresh_logits_h200_2026-12-01.json, phases serial_keep / in_flight_2 against
        serial_drop). With the output in one persistent buffer, every argument and result of the step keeps
        its address (benchmarks/results/graph_updates_h200_2026-12-01.json: no re-recording in any phase).
        The price: the logits a step returns are valid until the next step (``step``'s contract). Without a
        mesh only: a sharded output's layout is XLA's.
        """
        if self.mesh is not None:
            return None
        if self._logits_out is None or self._logits_out.is_deleted():
            self._logits_out = self._commit(jnp.zeros((self.max_num_seqs, self.model.cfg.vocab_size), jnp.float32))
        return self._logits_out

    def _segment_bounds(self) -> list[tuple[int, int]]:
        n, k, f = self.model.cfg.n_layers, self.segments, self.first_segment_layers
        if f:
            cuts = [0] + [f + round(i * (n - f) / (k - 1)) for i in range(k)]
        else:
            cuts = [round(i * n / k) for i in range(k + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    def _segment(self, k: int, kb: int) -> Callable:
        """Segment ``k`` of a fused step split into ``segments`` captured executables.

        Why: XLA launches a captured executable's command buffer only after updating and submitting
        all of it, so the device idles for the whole launch. Launched in pieces, the device runs the first
        piece while the host launches the next; only the first piece's launch stays on the critical path.
        What crosses a segment boundary (the hidden state, the step's batch, the logits indices) lives in
        persistent buffers: the first segment takes them donated and writes the step's values into them
        (its outputs mirror its donated inputs, so XLA aliases each output to the same buffer), and the
        middle segments update the hidden state in place. Every later segment therefore reads the same
        addresses every step, and XLA has no recorded command to update for them.
        """
        lo, hi = self._segment_bounds()[k]
        gds = [self._layers[i][0] for i in range(lo, hi)]
        first, last = k == 0, k == self.segments - 1
        egd, hgd = self._embed[0], self._head[0]

        def layers(sts, h, small, caches):
            out = []
            for gd, st, cache in zip(gds, sts, caches):
                h, cache = _merge(gd, st)(h, small, cache)
                out.append(self._pin_caches(cache))
            return self._pin_rows(h), out

        key = ("segment", k, kb, self.segments)
        if first:
            def seg(est, sts, packed, prev, state):
                _, bt_state, caches = state  # the carry's old values are overwritten
                tokens, _, li, small, bt = self._unpack(packed, bt_state, kb, prev)
                h, caches = layers(sts, _merge(egd, est)(self._pin_rows(tokens)), small, caches)
                return (h, self._pin_whole(small), self._pin_whole(li)), bt, caches
            # keep_unused: the carry's old values are not read, but its buffers must stay arguments so that
            # XLA aliases the outputs to them
            return self._jit(key, seg, eager=False, donate=(4,), keep_unused=True)
        if last:
            def seg(sts, hst, small, li, h, caches, out):  # out: the persistent logits buffer (_out_buffer)
                h, caches = layers(sts, h, small, caches)
                return _merge(hgd, hst)(h, li), caches
            return self._jit(key, seg, eager=False, donate=(5, 6), keep_unused=True)

        def seg(sts, small, state):
            return layers(sts, state[0], small, state[1])
        return self._jit(key, seg, eager=False, donate=(2,))

    def _segment_carry(self, tb: int, kb: int) -> tuple:
        """The persistent boundary buffers of (token bucket, key blocks): hidden state, batch, logits indices."""
        carry = self._carry.pop((tb, kb), None)
        if carry is None:
            r, i32 = self.max_num_seqs, jnp.int32
            h = self.model.zero_hidden(tb)
            small = PagedBatch(positions=jnp.zeros(tb, i32), req_idx=jnp.zeros(tb, i32),
                               slot_mapping=jnp.zeros(tb, i32), block_tables=jnp.zeros((r, kb), i32),
                               seq_lens=jnp.zeros(r, i32), query_start_loc=jnp.zeros(r + 1, i32))
            if self.mesh is None:
                carry = self._commit((h, small, jnp.zeros(r, i32)))
            else:  # in the layout the first segment returns them in
                rep = sharding.replicated(self.mesh)
                carry = (jax.device_put(h, self._rows_sh), jax.device_put(small, rep),
                         jax.device_put(jnp.zeros(r, i32), rep))
        return carry

    def _segment_args(self, k: int, inp: StepInputs, carry: tuple, boundary: tuple) -> tuple:
        """Segment ``k``'s arguments: ``carry`` the persistent boundary buffers (the first segment's
        donated state), ``boundary`` (hidden state, batch, logits indices) what the first returned."""
        lo, hi = self._segment_bounds()[k]
        sts, caches = [self._layers[i][1] for i in range(lo, hi)], self.caches[lo:hi]
        h, small, li = boundary
        if k == 0:
            return self._embed[1], sts, inp.packed, self._prev_of(inp), (carry, self._bt_state, caches)
        if k == self.segments - 1:
            return sts, self._head[1], small, li, h, caches, self._out_buffer()
        return sts, small, (h, caches)

    def _step_segments(self, inp: StepInputs) -> jax.Array:
        kb, bounds = inp.key_blocks, self._segment_bounds()
        carry = self._segment_carry(inp.token_bucket, kb)
        lo, hi = bounds[0]
        boundary, self._bt_state, self.caches[lo:hi] = self._segment(0, kb)(*self._segment_args(0, inp, carry, carry))
        self._tables_sent(inp)
        h, small, li = boundary
        for k in range(1, self.segments - 1):
            lo, hi = bounds[k]
            h, self.caches[lo:hi] = self._segment(k, kb)(*self._segment_args(k, inp, carry, (h, small, li)))
        lo, hi = bounds[-1]
        logits, self.caches[lo:hi] = self._segment(self.segments - 1, kb)(
            *self._segment_args(self.segments - 1, inp, carry, (h, small, li)))
        self._logits_out = logits if self.mesh is None else None
        self._carry[(inp.token_bucket, kb)] = (h, small, li)
        self.last_dispatch = DispatchStats(captured=self.segments)
        return logits

    def _fused_dev_args(self, inp: StepInputs) -> tuple:
        return self._whole[1], inp.packed, self._prev_of(inp), self._bt_state, self.caches, self._out_buffer()

    def _compile_fused(self, steps: list[StepInputs], progress: Callable[[str], None] | None) -> None:
        """Compile the executables of fused device-prep ``steps`` (one per bucket) on ``compile_workers``
        threads, without running them: each is traced and lowered here, in order, and compiled on a worker.

        Why: XLA compiles one executable at a time per call, and a segmented step has one per segment and
        bucket; a deep model's warm-up spent most of its time compiling them one after another. XLA's compile
        releases the GIL, so the workers overlap each other and the tracing. ``jit`` keeps each compiled
        executable for the later calls with arguments placed as these are (the segments' boundary buffers
        stand in for the first segment's outputs: they are the same buffers).
        """
        calls = []
        for inp in steps:
            if self.segments == 1:
                calls.append((self._fused_dev(inp.key_blocks), self._fused_dev_args(inp)))
                continue
            carry = self._segment_carry(inp.token_bucket, inp.key_blocks)
            calls += [(self._segment(k, inp.key_blocks), self._segment_args(k, inp, carry, carry))
                      for k in range(self.segments)]
            self._carry[(inp.token_bucket, inp.key_blocks)] = carry
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.compile_workers) as pool:
            done = [pool.submit(fn.lower(*args).compile) for fn, args in calls]
            for n, f in enumerate(done, 1):
                f.result()
                if progress and (n == len(done) or n % max(1, len(done) // 8) == 0):
                    progress(f"compiled {n}/{len(done)} executables on {self.compile_workers} threads "
                             f"[{time.perf_counter() - t0:.1f}s]")

    # ----- one step ---------------------------------------------------------------------------------
    def _step_shape(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray
                    ) -> tuple[int, np.ndarray, np.ndarray, int, int]:
        """A step's inputs checked against the runner's limits: (tokens, the caller's block tables, them padded to
        [max_num_seqs, max_blocks] with -1 as page 0, the token bucket, the key-block bucket)."""
        src = self._tables(block_tables)
        t, end = self._check_chunks(chunks, src.shape[0])
        if len(token_ids) != t:
            raise ValueError(f"token_ids has {len(token_ids)} tokens but the chunks hold {t}")
        return (t, src, self._padded(src)) + self._step_buckets(t, end)

    def _padded(self, src: np.ndarray) -> np.ndarray:
        """The caller's tables padded to [max_num_seqs, max_blocks], -1 (and any negative entry) as page 0."""
        bt = np.zeros((self.max_num_seqs, self.max_blocks), np.int32)
        np.maximum(src, 0, out=bt[: src.shape[0], : src.shape[1]])
        return bt

    def _step_buckets(self, tokens: int, end: int) -> tuple[int, int]:
        """(token bucket, key-block bucket) of a step of ``tokens`` tokens reaching position ``end``."""
        return _pick(self.token_buckets, tokens), _pick(self.key_block_buckets, -(-end // self.block_size))

    def _tables(self, block_tables: np.ndarray) -> np.ndarray:
        """The caller's block tables as int32 [rows, blocks], checked against the runner's limits."""
        src = block_tables
        if not isinstance(src, np.ndarray) or src.dtype != np.int32:
            src = np.asarray(src, np.int32)
        if src.ndim != 2:
            raise ValueError(f"block_tables must be 2-D [rows, blocks], got shape {src.shape}")
        if src.shape[1] > self.max_blocks:
            raise ValueError(f"block_tables has {src.shape[1]} columns, more than max_blocks={self.max_blocks}")
        if src.shape[0] > self.max_num_seqs:
            raise ValueError(f"block_tables has {src.shape[0]} rows, more than max_num_seqs={self.max_num_seqs}")
        return src

    def prepare_inputs(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray, *,
                       feed: np.ndarray | None = None, prev_tokens: jax.Array | None = None) -> tuple:
        """The arguments of ``step`` for one step: ``step(*runner.prepare_inputs(...))``.

        ``input_prep="device"``: a 1-tuple ``(StepInputs,)``: token ids, chunks and the changed
        block-table entries packed into one int32 array and sent in one transfer; the batch is built
        inside the captured executable. ``"host"``: (tokens, batch, logits_indices, the batch with block
        tables cut to this step's key-block bucket), built by ``make_batch`` and transferred field by field
        (with ``stable_inputs`` the arrays are valid until the next call of the same buckets).
        ``feed`` / ``prev_tokens`` (device prep only): token i is ``prev_tokens[feed[i]]`` where feed >= 0.
        """
        if feed is not None and self.input_prep != "device":
            raise ValueError("feed needs input_prep='device' (the host path feeds tokens in submit)")
        if self.input_prep == "device":
            return (self._prepare_device(token_ids, chunks, block_tables, feed, prev_tokens),)
        token_ids = np.asarray(token_ids)
        t, src, bt, tb, kb = self._step_shape(token_ids, chunks, block_tables)
        batch = make_batch(chunks, bt, self.block_size, pad_to=tb, host=True)
        # Checked on the host: reading a device copy back here would wait for the previous step.
        if (batch.slot_mapping[:t] >= self.num_blocks * self.block_size).any():
            raise ValueError("block_tables references a page outside the pool")
        tokens = np.zeros(tb, np.int32)
        tokens[:t] = token_ids
        ends = np.cumsum([c.num_tokens for c in chunks]) - 1
        li = np.zeros(self.max_num_seqs, np.int32)
        li[: len(chunks)] = ends
        tokens, batch, li, small_bt = self._commit((tokens, batch, li, bt[:, :kb]), replicated=True)  # one transfer
        small = replace_batch(batch, block_tables=small_bt)
        inputs = (tokens, batch, li, small)
        return self._stage((tb, kb), inputs) if self.stable_inputs else inputs

    def _prepare_device(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray,
                        feed: np.ndarray | None, prev_tokens: jax.Array | None) -> StepInputs:
        """``prepare_inputs`` under ``input_prep="device"``: the checks of ``make_batch``, then ``_pack``.

        Why so little numpy: this runs on the critical path right after the host waited for the previous
        step, when each distinct numpy call costs ten times or more its back-to-back cost (its code and data
        have left the core's caches; docs/perf-log.md, 2026-12-01, sixth session). So the chunks are checked in
        plain Python, and block tables equal to the ones the device holds (most steps) are recognised by one
        bytes comparison instead of being padded, range-checked and diffed.
        """
        if not isinstance(token_ids, np.ndarray):
            token_ids = np.asarray(token_ids)
        src = self._tables(block_tables)
        t, end = self._check_chunks(chunks, src.shape[0])
        if len(token_ids) != t:
            raise ValueError(f"token_ids has {len(token_ids)} tokens but the chunks hold {t}")
        key = src.tobytes()
        held = self._bt_source
        if held is not None and held[0] == src.shape and held[1] == key:  # the device holds these tables
            bt, outside = self._bt_host, held[2]
        else:
            bt = self._padded(src)
            outside = int(bt.max()) >= self.num_blocks
        if outside:  # some entry is outside the pool: is it one this step writes?
            for c in chunks:
                a, b = c.start // self.block_size, (c.start + c.num_tokens - 1) // self.block_size
                if (bt[c.req, a:b + 1] >= self.num_blocks).any():
                    raise ValueError("block_tables references a page outside the pool")
        return self._pack(token_ids, chunks, bt, *self._step_buckets(t, end), feed, prev_tokens,
                          source=(src.shape, key, outside))

    def _check_chunks(self, chunks: list[Chunk], src_rows: int) -> tuple[int, int]:
        """The step's chunks checked as ``make_batch`` checks them: (their tokens, the last position + 1)."""
        if not chunks:
            raise ValueError("chunks must not be empty")
        if len(chunks) > self.max_num_seqs:
            raise ValueError(f"{len(chunks)} request rows exceed max_num_seqs={self.max_num_seqs}")
        t = end = 0
        prev = -1
        for c in chunks:
            if not 0 <= c.req < src_rows:
                raise ValueError(f"chunk.req outside block_tables rows [0, {src_rows})")
            if c.req <= prev:
                raise ValueError("chunks must be given in increasing request-row order, one per row")
            prev = c.req
            if c.start < 0 or c.num_tokens < 1:
                raise ValueError("every chunk needs start >= 0 and num_tokens >= 1")
            e = c.start + c.num_tokens
            if e > self.max_model_len:
                raise ValueError(f"a chunk reaches position {e}, beyond max_model_len={self.max_model_len}")
            if (e - 1) // self.block_size >= self.max_blocks:
                raise ValueError("block_tables row is too short for a chunk's last position")
            t += c.num_tokens
            end = max(end, e)
        return t, end

    def _pack(self, token_ids: np.ndarray, chunks: list[Chunk], bt: np.ndarray, tb: int, kb: int,
              feed: np.ndarray | None = None, prev_tokens: jax.Array | None = None,
              source: tuple | None = None) -> StepInputs:
        """Diff the block tables ``bt`` (padded, checked) against the device's copy and pack the step
        (``jds.batch.pack_step``). ``source``: (shape, bytes, any page outside the pool) of the caller's
        tables, remembered once the step runs (``_prepare_device``'s fast path)."""
        if self.step_buffer == "pinned":  # before _bt_state can be replaced below: it is the guard
            arr, view = self._pinned_buffer(tb)
        if bt is self._bt_host:
            rows = cols = _NO_UPDATES
        else:
            rows, cols = np.nonzero(bt != self._bt_host)
        if len(rows) > self.update_capacity:  # more changed than one step carries: replace the whole table
            self._bt_state = self._commit(bt, replicated=True)
            self._bt_host, self._bt_source = bt, None  # the source is recorded when the step runs
            rows = cols = _NO_UPDATES
        updates = (rows, cols, bt[rows, cols] if len(rows) else rows)
        if self.step_buffer == "pinned":
            pack_step(token_ids, chunks, updates, num_tokens=tb, num_rows=self.max_num_seqs,
                      update_capacity=self.update_capacity, feed=feed, out=view)
            self._pinned_serial[tb] = serial = self._pinned_serial.get(tb, 0) + 1  # picks the other slot next
            return StepInputs(arr, tb, kb, bt, prev_tokens, serial, source)
        packed = pack_step(token_ids, chunks, updates, num_tokens=tb, num_rows=self.max_num_seqs,
                           update_capacity=self.update_capacity, feed=feed)
        # Without a mesh the numpy buffer goes straight into the executable's call: jit's C++ path copies it
        # to the device as part of the dispatch, cheaper on the host than a separate ``jax.device_put``.
        return StepInputs(packed if self.mesh is None else jax.device_put(packed), tb, kb, bt, prev_tokens,
                          source=source)

    def _tables_sent(self, inp: StepInputs) -> None:
        """A dispatched step's block tables are now the device's."""
        self._bt_host, self._bt_source = inp.block_tables, inp.source

    def _pinned_buffer(self, tb: int) -> tuple[jax.Array, np.ndarray]:
        """A persistent pinned-host step buffer of token bucket ``tb`` that no step can still be reading, and a
        numpy view of its memory.

        Why: a host-to-device transfer call per step cost host time on the critical path before the first
        kernel on the H200's host (docs/perf-log.md, 2026-12-01); the executable's own copy of a buffer written
        in place costs none, and the buffer keeps its address, so the graph's copy command never needs an
        update. Two buffers per bucket take turns, so the host can write step N+1's while step N runs; each
        remembers a small array made after the step that read it (``_witness``): once that is ready, the
        step's copy has happened and the memory may be rewritten.
        """
        ring = self._pinned.get(tb)
        if ring is None:
            n = step_buffer_len(tb, self.max_num_seqs, self.update_capacity)
            ring = self._pinned[tb] = []
            for _ in range(2):
                arr = jax.device_put(np.zeros(n, np.int32),
                                     jax.sharding.SingleDeviceSharding(self._device, memory_kind="pinned_host"))
                arr.block_until_ready()
                view = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(arr.unsafe_buffer_pointer()))
                ring.append([arr, view, None])
        slot = ring[self._pinned_serial.get(tb, 0) % 2]
        if slot[2] is not None:
            try:  # one call on the critical path; a deleted witness (given back by its owner) guards nothing
                slot[2].block_until_ready()
            except jax.errors.JaxRuntimeError:
                if not slot[2].is_deleted():
                    raise
        slot[2] = None
        return slot[0], slot[1]

    def _witness(self, tb: int, serial: int, marker: jax.Array) -> None:
        """Record ``marker`` (made on the device after the step of write ``serial`` of bucket ``tb``) as
        the sign that the step's pinned step buffer has been read."""
        self._pinned[tb][(serial - 1) % 2][2] = marker

    def _stage(self, key: Any, fresh: Any) -> Any:
        """Copy this step's inputs into the same device buffers as the last step of this shape.

        Why: a captured executable's command buffer records buffer addresses; inputs at new addresses
        each step may make XLA update the recorded graph at launch (host time that grows with its
        kernels). A donated ``dynamic_update_slice`` writes in place, so the addresses stay put (checked
        with ``unsafe_buffer_pointer`` in tests/test_runner.py). Costs one small dispatch per step.
        """
        prev = self._staged.get(key)
        self._staged[key] = jax.tree.map(jnp.copy, fresh) if prev is None else self._stage_in(prev, fresh)
        return self._staged[key]

    def execute(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray) -> np.ndarray:
        """One step; float32 logits [len(chunks), vocab] of each chunk's last token."""
        logits = self.step(*self.prepare_inputs(token_ids, chunks, block_tables))
        return np.asarray(logits[: len(chunks)])

    def step(self, *inputs: Any) -> jax.Array:
        """Dispatch one step in this runner's mode from ``prepare_inputs``'s tuple; the caches advance in
        place of ``self.caches``. Returns the device logits [max_num_seqs, vocab] (rows past the step's
        chunks are padding). A fused step with device input preparation writes them into the runner's
        persistent output buffer (``_out_buffer``): they are valid until the next step, which takes that
        buffer back (reading them later raises JAX's deleted-array error); copy or sample them first."""
        if len(inputs) == 1 and isinstance(inputs[0], StepInputs):
            return self._step_device(inputs[0])
        return self._step_host(*inputs)

    def _prev_of(self, inp: StepInputs) -> jax.Array:
        """The feed's source: the previous step's sampled tokens, or (no feed) a fixed zero array, so the
        executable's signature and the graph's argument addresses do not change."""
        if inp.prev_tokens is not None:
            return inp.prev_tokens
        if self._no_prev is None:
            zero = np.zeros(self.max_num_seqs, np.int32)
            self._no_prev = self._commit(zero) if self.mesh is None else jnp.asarray(zero)
        return self._no_prev

    def _step_device(self, inp: StepInputs, witness: bool = True) -> jax.Array:
        """``witness=False``: the caller records the step's witness itself (``submit``: its sampled tokens)."""
        pinned = self.step_buffer == "pinned"
        if pinned and inp.serial != self._pinned_serial.get(inp.token_bucket):
            raise ValueError("these StepInputs are stale: prepare_inputs wrote the same token bucket's step buffer "
                             "again since (with step_buffer='pinned', step the inputs of the last prepare_inputs)")
        logits = self._dispatch_device(inp)
        if pinned and witness:  # after the launch, off the critical path
            self._witness(inp.token_bucket, inp.serial, self._marker(self._bt_state))
        return logits

    def _dispatch_device(self, inp: StepInputs) -> jax.Array:
        stats = DispatchStats(captured=1)
        kb = inp.key_blocks
        if self.mode == "fused" and self.segments > 1:
            return self._step_segments(inp)
        if self.mode == "fused":
            logits, self.caches, self._bt_state = self._fused_dev(kb)(*self._fused_dev_args(inp))
            self._tables_sent(inp)
            self._logits_out = logits if self.mesh is None else None
            self.last_dispatch = stats
            return logits
        kinds, layers = self._kinds, self._layers
        h, x, self.caches[0], self._bt_state, batch, small, li = self._first_dev(kinds[0], kb)(
            self._embed[1], layers[0][1], inp.packed, self._prev_of(inp), self._bt_state, self.caches[0])
        self._tables_sent(inp)
        logits = self._layer_loop(h, x, batch, small, li, stats)
        self.last_dispatch = stats
        return logits

    def _step_host(self, tokens: jax.Array, batch: PagedBatch, logits_indices: jax.Array,
                   small: PagedBatch) -> jax.Array:
        """``small`` is ``batch`` with block tables cut to this step's key-block bucket (built on the host)."""
        stats = DispatchStats()
        if self.mode == "fused":
            logits, self.caches = self._fused()(self._whole[1], tokens, small, self.caches, logits_indices)
            stats.captured += 1
            self.last_dispatch = stats
            return logits
        kinds, layers = self._kinds, self._layers
        h, x, self.caches[0] = self._first(kinds[0])(self._embed[1], layers[0][1], tokens, batch, self.caches[0])
        stats.captured += 1
        logits = self._layer_loop(h, x, batch, small, logits_indices, stats)
        self.last_dispatch = stats
        return logits

    def _layer_loop(self, h: jax.Array, x: Any, batch: PagedBatch, small: PagedBatch, logits_indices: jax.Array,
                    stats: DispatchStats) -> jax.Array:
        """wide / narrow after the first segment: per layer the eager call, then the next captured one."""
        kinds, layers = self._kinds, self._layers
        for i in range(len(layers)):
            if self.mode == "narrow":
                o = self._eager(kinds[i])(layers[i][1], x, small, self.caches[i])
            else:
                o, self.caches[i] = self._eager(kinds[i])(layers[i][1], x, small, self.caches[i])
            stats.eager += 1
            if i + 1 < len(layers):
                h, x, self.caches[i + 1] = self._mid(kinds[i], kinds[i + 1])(
                    layers[i][1], layers[i + 1][1], h, o, batch, self.caches[i + 1])
            else:
                logits = self._last(kinds[i])(layers[i][1], self._head[1], h, o, logits_indices)
            stats.captured += 1
        return logits

    # ----- async stepping (sampling and token feed on the device) -----------------------------------
    def submit(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray,
               sampling: "SamplingRows", feed: np.ndarray) -> "DevicePending":
        """Enqueue one step and its sampling; return without waiting for the device.

        ``token_ids[i] == -1`` is a placeholder for the token that row ``feed[i]`` sampled in the previous
        ``submit`` (``feed[i] == -1`` elsewhere): it is gathered on the device, so the host never reads
        that token before enqueueing this step. Built on ``prepare_inputs`` + ``step``; nothing here blocks.
        """
        token_ids = np.asarray(token_ids, np.int64)
        feed = np.asarray(feed, np.int64)
        if feed.shape != token_ids.shape:
            raise ValueError(f"feed has shape {feed.shape}, token_ids {token_ids.shape}")
        hole = token_ids == -1
        if (hole != (feed >= 0)).any():
            raise ValueError("feed must be >= 0 exactly where token_ids holds the placeholder -1")
        if len(sampling) != len(chunks):
            raise ValueError(f"sampling has {len(sampling)} rows for {len(chunks)} chunks")
        if hole.any():
            if self._prev_sampled is None:
                raise ValueError("token_ids holds placeholders but no step was submitted before")
            if feed[hole].max() >= self._prev_rows:
                raise ValueError(f"feed names row {int(feed[hole].max())} of a step with {self._prev_rows} rows")
        if ((token_ids < -1) | (token_ids >= self.model.cfg.vocab_size)).any():
            raise ValueError(f"token_ids must be in [0, {self.model.cfg.vocab_size}) or the placeholder -1")
        ids = np.where(hole, 0, token_ids).astype(np.int32)
        r, m = len(chunks), self.max_num_seqs
        if self.input_prep == "device":  # the feed travels in the packed buffer; the graph gathers it
            inputs = self.prepare_inputs(ids, chunks, block_tables, feed=feed.astype(np.int32) if hole.any() else None,
                                         prev_tokens=self._prev_sampled if hole.any() else None)
        else:
            inputs = self.prepare_inputs(ids, chunks, block_tables)
        fpad, rows = None, None
        if hole.any() and self.input_prep != "device":
            tokens = inputs[0]
            fpad = np.full(tokens.shape[0], -1, np.int32)
            fpad[: len(feed)] = feed
        if not sampling.greedy.all():
            greedy = np.ones(m, bool)
            greedy[:r] = sampling.greedy
            temp, top_p = np.ones(m, np.float32), np.ones(m, np.float32)
            temp[:r], top_p[:r] = sampling.temperature, sampling.top_p
            top_k, index = np.zeros(m, np.int32), np.zeros(m, np.int32)
            top_k[:r], index[:r] = sampling.top_k, sampling.index
            seeds = np.zeros(m, np.uint64)
            seeds[:r] = sampling.seed
            rows = (greedy, temp, top_k, top_p, split_seeds(seeds), index)
        fpad, rows = self._commit((fpad, rows), replicated=True)  # one transfer call (None stays None)
        if fpad is not None:
            inputs = (_feed_tokens(inputs[0], self._prev_sampled, fpad),) + tuple(inputs[1:])
        device_prep = isinstance(inputs[0], StepInputs)
        logits = self._step_device(inputs[0], witness=False) if device_prep else self.step(*inputs)
        # the ids stay on the device for the next step's feed, and the same executable copies them into pinned
        # host memory, so result() reads them without a transfer call after the step (docs/perf-log.md)
        sampled, on_host = greedy_tokens_host(logits) if rows is None else sample_tokens_host(logits, *rows)
        if device_prep and self.step_buffer == "pinned":
            self._witness(inputs[0].token_bucket, inputs[0].serial, sampled)
        self._prev_sampled, self._prev_rows = sampled, r
        return DevicePending(on_host, r)

    # ----- MTP speculative decoding (jds.engine.core, speculative="mtp") -----------------------------
    def enable_mtp(self) -> None:
        """Allocate the MTP module's own paged caches (they share the main model's page ids and block tables).

        Why a separate switch: a model without speculation must not pay for the MTP cache. Only what the
        speculative steps below make exact is accepted: a block-v4 model with an MTP module, the ``fused`` mode in
        one segment, no device mesh. The speculative steps are their own executables (host input preparation, the
        whole model in one call), so ``input_prep`` does not apply to them; ``stable_inputs`` is refused."""
        cfg = self.model.cfg
        if cfg.block != "v4" or not cfg.mtp_layers:
            raise ValueError(f"speculative: 'mtp' needs a block-v4 model with mtp_layers > 0, got block={cfg.block!r}, "
                             f"mtp_layers={cfg.mtp_layers}")
        if self.mode != "fused":
            raise ValueError(f"mode: speculative 'mtp' runs only in mode 'fused', got {self.mode!r}")
        if self.segments != 1:
            raise ValueError(f"segments: speculative 'mtp' needs segments=1, got {self.segments}")
        if self.mesh is not None:
            raise ValueError("tensor_parallel / data_parallel / expert_parallel: speculative 'mtp' runs on one "
                             "device only (no mesh)")
        if self.stable_inputs:
            raise ValueError("stable_inputs: not supported with speculative 'mtp' (its steps prepare inputs on the host)")
        if getattr(self, "mtp_caches", None) is None:
            self.mtp_caches = self.model.init_mtp_caches(self.num_blocks)
            self._mtp = _split_flat(self._served.mtp[0])
        self._spec_last: tuple[jax.Array, PagedBatch] | None = None

    def _spec_main(self) -> Callable:
        gd = self._whole[0]

        def main(st, tokens, batch, caches, rows):
            model = _merge(gd, st)
            h, caches = model.forward_hidden(tokens, batch, caches)
            greedy = jnp.argmax(model.head(h, rows), axis=-1).astype(jnp.int32)
            return greedy, h.streams, caches

        return self._jit(("spec_main",), main, eager=False, donate=(3,))

    def _spec_draft(self) -> Callable:
        mgd, egd, hgd = self._mtp[0], self._embed[0], self._head[0]

        def draft(mst, est, hst, streams, next_tokens, batch, cache, rows):
            out = _merge(mgd, mst)(streams, next_tokens, batch, cache, _merge(egd, est), _merge(hgd, hst), rows)
            return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache

        return self._jit(("spec_draft",), draft, eager=False, donate=(6,))

    def _spec_inputs(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray) -> tuple:
        """Host-built (tokens, batch with block tables cut to the key-block bucket), as the host path makes them."""
        if getattr(self, "mtp_caches", None) is None:
            raise ValueError("speculative steps need enable_mtp() first")
        t, _, bt, tb, kb = self._step_shape(token_ids, chunks, block_tables)
        batch = make_batch(chunks, bt[:, :kb], self.block_size, pad_to=tb, host=True)
        if (batch.slot_mapping[:t] >= self.num_blocks * self.block_size).any():
            raise ValueError("block_tables references a page outside the pool")
        tokens = np.zeros(tb, np.int32)
        tokens[:t] = token_ids
        return tokens, batch

    def verify(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray) -> np.ndarray:
        """The main model's step for speculative decoding: greedy tokens [len(chunks), 2] at each chunk's last two
        rows (a 1-token chunk repeats its row), so a chunk [last token, draft] is verified in one step. Keeps the
        final hidden streams and the batch on the runner for the ``draft`` call that follows."""
        tokens, batch = self._spec_inputs(np.asarray(token_ids), chunks, block_tables)
        ends = np.cumsum([c.num_tokens for c in chunks]) - 1
        starts = ends - np.asarray([c.num_tokens for c in chunks]) + 1
        rows = np.zeros(2 * self.max_num_seqs, np.int32)
        rows[: 2 * len(chunks)] = np.stack([np.maximum(ends - 1, starts), ends], axis=1).reshape(-1)
        greedy, streams, self.caches = self._spec_main()(self._whole[1], *jax.device_put((tokens, batch)),
                                                         self.caches, jax.device_put(rows))
        self._spec_last = (streams, batch)
        self.last_dispatch = DispatchStats(captured=1)
        return np.asarray(greedy)[: 2 * len(chunks)].reshape(len(chunks), 2)

    def draft(self, next_tokens: np.ndarray, keep: np.ndarray, draft_rows: np.ndarray) -> np.ndarray:
        """The MTP step over the last ``verify``'s rows: row t pairs its final streams (position p_t) with
        ``next_tokens[t]`` (the token at p_t + 1); rows with ``keep`` False (a rejected draft's position) write
        no MTP cache entry (slot -1), so the MTP cache never holds a rejected token. Returns the greedy draft
        [len(draft_rows)] for position p + 2 of each row in ``draft_rows``."""
        if getattr(self, "_spec_last", None) is None:
            raise ValueError("draft() needs a verify() step before it")
        streams, batch = self._spec_last
        self._spec_last = None
        t = len(next_tokens)
        nxt = np.zeros(streams.shape[0], np.int32)
        nxt[:t] = next_tokens
        slots = np.array(batch.slot_mapping, np.int32)
        slots[:t] = np.where(np.asarray(keep, bool), slots[:t], -1)
        rows = np.zeros(self.max_num_seqs, np.int32)
        rows[: len(draft_rows)] = draft_rows
        mbatch = replace_batch(batch, slot_mapping=slots)
        est, hst = self._embed[1], self._head[1]
        drafts, self.mtp_caches[0] = self._spec_draft()(self._mtp[1], est, hst, streams,
                                                        *jax.device_put((nxt, mbatch)), self.mtp_caches[0],
                                                        jax.device_put(rows))
        return np.asarray(drafts)[: len(draft_rows)]

    def warmup_speculative(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile the speculative executables for every (token bucket x key-block bucket) with all-padding steps."""
        t0 = time.perf_counter()
        for tb in self.token_buckets:
            for kb in self.key_block_buckets:
                batch = make_batch([], np.zeros((self.max_num_seqs, kb), np.int32), self.block_size, pad_to=tb,
                                   host=True)
                rows = np.zeros(2 * self.max_num_seqs, np.int32)
                _, streams, self.caches = self._spec_main()(self._whole[1], *jax.device_put(
                    (np.zeros(tb, np.int32), batch)), self.caches, jax.device_put(rows))
                self._spec_last = (streams, batch)
                self.draft(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int32))
        if progress:
            progress(f"compiled the speculative (mtp) steps [{time.perf_counter() - t0:.1f}s]")

    def warmup_submit(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile what ``submit`` adds to ``warmup``: the token feed per token bucket and both samplers."""
        m, v = self.max_num_seqs, self.model.cfg.vocab_size
        logits = np.zeros((m, v), np.float32)  # placed as the steps return theirs (committed: one compile)
        logits = jax.device_put(logits, self._logits_sharding) if self._logits_sharding else self._commit(logits)
        rows = (np.ones(m, bool), np.ones(m, np.float32), np.zeros(m, np.int32), np.ones(m, np.float32),
                np.zeros((m, 2), np.uint32), np.zeros(m, np.int32))
        prev = greedy_tokens_host(logits)[0]
        jax.block_until_ready(sample_tokens_host(logits, *self._commit(rows, replicated=True)))
        for tb in self.token_buckets:  # placed as submit's host inputs are
            tokens, feed = self._commit((np.zeros(tb, np.int32), np.full(tb, -1, np.int32)), replicated=True)
            jax.block_until_ready(_feed_tokens(tokens, prev, feed))
        if progress:
            progress(f"compiled the device sampler and {len(self.token_buckets)} token feeds")

    def warmup(self, progress: Callable[[str], None] | None = None,
               buckets: list[tuple[int, int]] | None = None) -> None:
        """Compile every (token bucket x key-block bucket) executable, or those of ``buckets``, with
        all-padding steps."""
        combos = [(tb, kb) for tb in self.token_buckets for kb in self.key_block_buckets]
        if buckets is not None:
            bad = [b for b in buckets if tuple(b) not in combos]
            if bad:
                raise ValueError(f"buckets: {bad} are not (token bucket, key-block bucket) pairs of this runner "
                                 f"(token_buckets={self.token_buckets}, key_block_buckets={self.key_block_buckets})")
            combos = [tuple(b) for b in buckets]
        if self.mode == "fused" and self.input_prep == "device" and self.compile_workers > 1:
            # with pinned step buffers each _pack takes the next buffer of the bucket's pair: no step runs
            # between these, so none is in use
            self._compile_fused([self._pack(np.zeros(0, np.int32), [], self._bt_host, tb, kb)
                                 for tb, kb in combos], progress)
        t0 = time.perf_counter()
        for n, (tb, kb) in enumerate(combos, 1):
            if self.input_prep == "device":  # an all-padding step: no chunks, no block-table updates
                empty = self._pack(np.zeros(0, np.int32), [], self._bt_host, tb, kb)
                self._logits_sharding = jax.block_until_ready(self.step(empty)).sharding
                if progress:
                    progress(f"compiled bucket {n}/{len(combos)} (tokens={tb}, key_blocks={kb}) "
                             f"[{time.perf_counter() - t0:.1f}s]")
                continue
            bt = np.zeros((self.max_num_seqs, self.max_blocks), np.int32)
            batch = make_batch([], bt, self.block_size, pad_to=tb, host=True)
            tokens, batch, li, small_bt = self._commit(  # placed as prepare_inputs places a step's
                (np.zeros(tb, np.int32), batch, np.zeros(self.max_num_seqs, np.int32), bt[:, :kb]), replicated=True)
            small = replace_batch(batch, block_tables=small_bt)
            self._logits_sharding = jax.block_until_ready(self.step(tokens, batch, li, small)).sharding
            if progress:
                progress(f"compiled bucket {n}/{len(combos)} (tokens={tb}, key_blocks={kb}) "
                         f"[{time.perf_counter() - t0:.1f}s]")


@jax.jit
def _feed_tokens(tokens: jax.Array, prev: jax.Array, feed: jax.Array) -> jax.Array:
    """tokens[i] = prev[feed[i]] where feed[i] >= 0: the previous step's sampled ids, gathered on the device."""
    return jnp.where(feed >= 0, prev[jnp.maximum(feed, 0)], tokens)


class DevicePending:
    """A submitted step's sampled tokens (their pinned-host copy), in flight until ``result()``."""

    def __init__(self, sampled: jax.Array, rows: int) -> None:
        self._sampled = sampled
        self._rows = rows

    def result(self) -> np.ndarray:
        return np.asarray(self._sampled)[: self._rows]


class ModelRunner(BoundaryRunner):
    """The server-facing runner (see jds/engine): builds a Decoder from a preset/config/checkpoint."""

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.model.cfg.eos_token_id

    @property
    def bos_token_id(self) -> int:
        return self.model.cfg.bos_token_id

    @classmethod
    def build(cls, *, preset: str | None = None, config_path: str | None = None, checkpoint: str | None = None,
              model_config: ModelConfig | None = None, model_overrides: dict[str, Any] | None = None,
              implementation: str = "auto", seed: int = 0, runner: RunnerConfig | None = None,
              progress: Callable[[int, int], None] | None = None, **settings: Any) -> "ModelRunner":
        """A runner over a model from one source, with ``runner``'s settings (default ``RunnerConfig()``).

        The model: ``model_config``; or the preset (default v32-tiny) with its attention replaced from the HF
        ``config_path`` and ``model_overrides`` (ModelConfig fields, e.g. the MoE ones) applied; or, with
        ``checkpoint`` alone, the checkpoint's stored config. Given another source too, the checkpoint must
        match it (a mismatch is a ValueError naming the first differing parameter). ``settings``: RunnerConfig
        fields replacing ``runner``'s, as ``BoundaryRunner`` takes them. ``progress(done, total)``: called per
        tensor placed when a checkpoint loads straight into shards (a parallel config).
        """
        if model_config is not None and (preset is not None or config_path or model_overrides):
            raise ValueError("model_config: give it alone, or preset / config_path / model_overrides")
        config = runner if runner is not None else RunnerConfig()
        if settings:
            config = replace(config, **settings)
        if checkpoint and model_config is None and preset is None and not config_path and not model_overrides:
            from jds.checkpoint import checkpoint_config, restore_model, restore_sharded
            if sharding.uses_mesh(config):  # straight into the shards: no whole-model copy on one device
                sharding.check_divisible(checkpoint_config(checkpoint), config)  # before reading any tensor
                model = restore_sharded(checkpoint, sharding.make_mesh(config), implementation=implementation,
                                        seed=seed, progress=progress)
            else:
                model = restore_model(checkpoint, implementation=implementation, seed=seed)
        else:
            cfg = model_config or load_model_config(preset or "v32-tiny", config_path, **(model_overrides or {}))
            model = Decoder(cfg, seed=seed, implementation=implementation)
            if checkpoint:
                from jds.checkpoint import load_checkpoint
                load_checkpoint(model, checkpoint)
        return cls(model, config)


def enable_compile_cache(cache_dir: str) -> None:
    """Persist every compiled executable (no size or compile-time threshold) under ``cache_dir``, so a
    restarted server, or a timed run after a parallel precompile, loads instead of compiling."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def serving_copy(model: Any, mesh: Any) -> Any:
    """The model as the runner's executables read it: a copy of its graph (the same parameter arrays) whose
    layers hold what they would otherwise derive from their weights every step (``hold_absorbed``: V3.2's W_UK
    / W_UV dequantised from an FP8 ``wkv_b``), placed by the partition rules on a mesh. The caller's model is
    left as it is, so loading new weights into it later never meets stale derived values there; the runner's
    parameters are fixed at its construction anyway (``_split_flat``)."""
    gd, state = nnx.split(model)
    served = nnx.merge(gd, state)
    holders = [node for _, node in nnx.iter_graph(served) if hasattr(node, "hold_absorbed")]
    for node in holders:
        node.hold_absorbed()
    if holders and mesh is not None:
        st = nnx.state(served)
        nnx.update(served, jax.device_put(st, sharding.param_shardings(st, model.cfg, mesh)))
    return served


def _split_flat(module: nnx.Module) -> tuple[Any, list[jax.Array]]:
    """(graphdef + treedef, parameter leaves) so a jitted call receives a plain list of arrays."""
    gd, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return (gd, treedef), leaves


def _merge(gd_treedef: tuple[Any, Any], leaves: list[jax.Array]) -> Any:
    gd, treedef = gd_treedef
    return nnx.merge(gd, jax.tree.unflatten(treedef, leaves))


def _producers(layer: Any, h: jax.Array, batch: PagedBatch, cache: Any, narrow: bool) -> tuple[Any, Any]:
    """The captured producer tail of a segment: input projections, plus (narrow) the whole ``prepare``.

    Returns what the eager call consumes (``V*Query`` when narrow, ``V*Inputs`` when wide) and the cache.
    """
    inp = layer.pre_attention(h)
    if narrow:
        return layer.attn.prepare(inp, batch, cache)
    return inp, cache
