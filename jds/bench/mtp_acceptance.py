"""Offline MTP acceptance: how often DeepSeek-V4's MTP module (``jds.mtp``) drafts the model's own greedy token.

    python -m jds.bench.mtp_acceptance --preset v4-tiny-block --prompt-len 32 --new-tokens 64 \\
        --out benchmarks/cpu/mtp_acceptance_cpu_<date>.json
    python -m jds.bench.mtp_acceptance --checkpoint CONVERTED_DIR ...   (a converted checkpoint with mtp.* weights)

What is measured: the model decodes ``--new-tokens`` tokens greedily after a seeded random prompt. At every
position t from the prompt's last one on, the MTP takes the model's final hidden streams at t and the greedy token
t+1 and drafts token t+2 (prefill: the MTP runs over the whole prompt, so its own cache holds every position, as an
engine running it after each verified step would); a draft is accepted when it equals the model's greedy token
t+2. ``acceptance`` = accepted / drafts. With greedy verification the tokens a speculative engine emits are these
same greedy tokens, and the MTP sees the same (accepted) positions, so this is the per-draft acceptance of
one-draft-per-step speculative decoding.

Speed-up with one draft token per step (stated, not simulated):
    tokens per verify step  = 1 + acceptance        (the verified token, plus the draft when accepted; drafts taken
                                                     as independent of each other)
    verify step's cost       = T2 / T1               (T1: a 1-token decode step, T2: a 2-token one, same request)
    speedup                  = (1 + acceptance) / (T2 / T1)
    speedup_with_draft_cost  = (1 + acceptance) / ((T2 + T_mtp) / T1)   (T_mtp: the MTP's 1-row step)
T1, T2, T_mtp are medians of ``--repeats`` jitted calls, interleaved, ON THIS MACHINE (labelled in the JSON; on a
CPU the tiny presets' steps are dispatch-bound and noisy, so T2 / T1 says little about an accelerator, whose decode
steps are bandwidth-bound with T2 / T1 near 1).

Random weights (the presets) give a near-zero acceptance: the MTP was never trained to predict the model. The
number is then the pipeline check (hidden streams, token pairing, MTP cache), not a property of DeepSeek-V4.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

import numpy as np


def _greedy_with_drafts(model: Any, prompt: np.ndarray, new_tokens: int) -> dict[str, Any]:
    """Greedy decode with an MTP draft at every step; returns the tokens, the drafts and the jitted steps."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jds.batch import Chunk, make_batch

    cfg = model.cfg
    bs = cfg.block_size
    n_blocks = -(-(len(prompt) + new_tokens + 3) // bs)
    bt = np.arange(n_blocks, dtype=np.int32)[None]
    graphdef, state = nnx.split(model)

    @jax.jit
    def main_step(state: Any, tokens: jax.Array, batch: Any, caches: Any, li: jax.Array) -> Any:
        m = nnx.merge(graphdef, state)
        h, caches = m.forward_hidden(tokens, batch, caches)
        return m.head(h, li), h.streams, caches

    @jax.jit
    def mtp_step(state: Any, streams: jax.Array, nxt: jax.Array, batch: Any, cache: Any, li: jax.Array) -> Any:
        m = nnx.merge(graphdef, state)
        out = m.mtp[0](streams, nxt, batch, cache, m.embed, m.head, li)
        return out.logits, out.cache

    caches, mcache = model.init_caches(n_blocks), model.mtp[0].init_cache(n_blocks)
    p = len(prompt)
    batch = make_batch([Chunk(0, 0, p)], bt, bs)
    logits, streams, caches = main_step(state, jnp.asarray(prompt, jnp.int32), batch, caches, jnp.asarray([p - 1]))
    tokens = [int(np.argmax(np.asarray(logits[0])))]  # greedy token at position p
    nxt = np.concatenate([prompt[1:], tokens]).astype(np.int32)  # row t pairs h_t with token t+1
    dl, mcache = mtp_step(state, streams, jnp.asarray(nxt), batch, mcache, jnp.asarray([p - 1]))
    drafts = {p + 1: int(np.argmax(np.asarray(dl[0])))}  # position -> drafted token
    one = jnp.asarray([0])
    for i in range(new_tokens - 1):
        q = p + i  # decode the token at position q
        batch = make_batch([Chunk(0, q, 1)], bt, bs)
        logits, streams, caches = main_step(state, jnp.asarray([tokens[-1]], jnp.int32), batch, caches, one)
        tokens.append(int(np.argmax(np.asarray(logits[0]))))  # position q + 1
        dl, mcache = mtp_step(state, streams, jnp.asarray([tokens[-1]], jnp.int32), batch, mcache, one)
        drafts[q + 2] = int(np.argmax(np.asarray(dl[0])))
    return {"tokens": tokens, "drafts": drafts, "main_step": main_step, "mtp_step": mtp_step, "state": state,
            "caches": caches, "mcache": mcache, "bt": bt, "p": p}


def _time_interleaved(fns: list[Any], repeats: int) -> list[list[float]]:
    """Seconds per call of each function, the calls interleaved (f0, f1, f2, f0, ...) so that a machine shared with
    other work slows them alike and their ratio stays meaningful; each is compiled and warmed first."""
    import jax

    for fn in fns:
        jax.block_until_ready(fn())
        jax.block_until_ready(fn())
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, out):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v4-tiny-block", help="a block-v4 preset (random weights), given mtp_layers=1")
    ap.add_argument("--checkpoint", default=None, help="a jds checkpoint with MTP modules instead of a preset")
    ap.add_argument("--seed", type=int, default=0, help="weights (preset) and prompt seed")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per step kind")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(a, name) < (2 if name == "new_tokens" else 1):
            raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(a, name)}")

    import jax
    import jax.numpy as jnp

    from jds.batch import Chunk, make_batch
    from jds.bench.results import write_json
    from jds.bench.stats import summarize
    from jds.config import preset
    from jds.model import Decoder

    t0 = time.perf_counter()
    if a.checkpoint:
        from jds.checkpoint import restore_model

        model = restore_model(a.checkpoint)
        if not model.cfg.mtp_layers:
            raise ValueError(f"--checkpoint {a.checkpoint!r}: the model has no MTP module (mtp_layers=0)")
        source = f"checkpoint {a.checkpoint}"
    else:
        model = Decoder(preset(a.preset, mtp_layers=1), seed=a.seed)
        source = f"preset {a.preset} (random weights, seed {a.seed})"
    cfg = model.cfg
    backend = jax.default_backend()
    res: dict[str, Any] = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(["python -m jds.bench.mtp_acceptance"] + (sys.argv[1:] if argv is None else argv)),
        "jax": jax.__version__, "backend": backend, "device": str(jax.devices()[0].device_kind),
        "timing_label": f"{backend.upper()} (this machine)"
                        + (": NOT an accelerator timing" if backend == "cpu" else ""),
        "model": source, "n_layers": cfg.n_layers, "mtp_layers": cfg.mtp_layers, "dtype": cfg.numerics.dtype,
        "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "repeats": a.repeats,
        "build_s": time.perf_counter() - t0, "cpu_count": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0],
        "complete": False}}
    if not a.checkpoint:
        res["meta"]["note"] = ("random weights: the MTP was never trained to predict this model, so the acceptance is "
                               "near zero by construction; it checks the pipeline, it is not a DeepSeek-V4 property")
    prompt = np.random.default_rng(a.seed).integers(0, cfg.vocab_size, a.prompt_len).astype(np.int32)
    t1 = time.perf_counter()
    run = _greedy_with_drafts(model, prompt, a.new_tokens)
    tokens, drafts, p = run["tokens"], run["drafts"], run["p"]
    # drafts whose target position was generated: draft for position q vs the greedy token at q (tokens[q - p])
    judged = sorted(q for q in drafts if q - p < len(tokens))
    hits = [drafts[q] == tokens[q - p] for q in judged]
    acc = float(np.mean(hits)) if hits else 0.0
    res["acceptance"] = {"drafts": len(judged), "accepted": int(np.sum(hits)), "acceptance": acc,
                         "rollout_s": time.perf_counter() - t1,
                         "greedy_tokens": tokens, "drafts_by_position": {str(q): drafts[q] for q in judged}}
    write_json(a.out, res)

    # step costs at the end of the rollout: 1-token and 2-token decode of the same request, the MTP's 1-row step
    st, bt, bs = run["state"], run["bt"], cfg.block_size
    q = p + len(tokens) - 1
    b1, b2 = make_batch([Chunk(0, q, 1)], bt, bs), make_batch([Chunk(0, q, 2)], bt, bs)
    ids1, ids2 = jnp.asarray(tokens[-1:], jnp.int32), jnp.asarray([tokens[-1], drafts.get(q + 1, 0)], jnp.int32)
    main_step, mtp_step, caches, mcache = run["main_step"], run["mtp_step"], run["caches"], run["mcache"]
    streams1 = jnp.zeros((1, cfg.hc_mult, cfg.hidden_size), model.embed.weight[...].dtype)
    li1, li2 = jnp.asarray([0]), jnp.asarray([0, 1])
    t_1, t_2, t_m = _time_interleaved([lambda: main_step(st, ids1, b1, caches, li1),
                                       lambda: main_step(st, ids2, b2, caches, li2),
                                       lambda: mtp_step(st, streams1, ids1, b1, mcache, li1)], a.repeats)
    m1, m2, mm = (float(np.median(x)) for x in (t_1, t_2, t_m))
    ratio = m2 / m1
    res["speedup"] = {
        "label": res["meta"]["timing_label"],
        "formula": "speedup = (1 + acceptance) / (T2 / T1); speedup_with_draft_cost = (1 + acceptance) / "
                   "((T2 + T_mtp) / T1); T1 / T2 = medians of a 1- / 2-token decode step, T_mtp = the MTP's 1-row step",
        "t1_ms": summarize(t_1), "t2_ms": summarize(t_2), "t_mtp_ms": summarize(t_m),
        "cost_ratio_t2_over_t1": ratio, "speedup": (1 + acc) / ratio,
        "speedup_with_draft_cost": (1 + acc) / ((m2 + mm) / m1)}
    res["meta"]["load_avg_1m_end"] = os.getloadavg()[0]  # other work on a shared machine shows here
    res["meta"]["complete"] = True
    write_json(a.out, res)
    print(json.dumps({k: v for k, v in res["acceptance"].items() if k in ("drafts", "accepted", "acceptance")}
                     | {k: v for k, v in res["speedup"].items() if k in ("cost_ratio_t2_over_t1", "speedup",
                                                                          "speedup_with_draft_cost")}))
    return res


if __name__ == "__main__":
    main()
