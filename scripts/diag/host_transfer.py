"""What a small host->device input and a small device->host result cost on the host's critical path.

    python3 scripts/diag/host_transfer.py --out OUT/host_transfer.json

Why: on the H200 host (2026-12-01, second session) the first segment of a TTFT step spent ~0.45 ms more
host time than the others, and ``jax.device_put`` of the 4 KB packed step buffer as much: the transfer,
not the launch. This measures, for a jitted consumer of a [n] int32 step buffer behind ~1 ms of device work:

- ``numpy``: the buffer passed as a numpy argument (jit copies it to the device in the dispatch);
- ``device_put``: ``jax.device_put`` first, then the call;
- ``pinned``: one persistent ``pinned_host`` array, written in place through a numpy view of its memory, that
  the executable copies to the device itself (``jax.device_put`` to device memory inside the jit);
and on the way back, the greedy ids [64] read with ``np.asarray`` from device memory or from a
``pinned_host`` output. Per case: the host time of the call and the round trip (inputs -> ids on the host),
medians over ``--n`` steps, and whether the in-place writes reached the executable (correctness).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--size", type=int, default=1024, help="int32 entries of the step buffer")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    on_dev, on_pin = SingleDeviceSharding(dev), SingleDeviceSharding(dev, memory_kind="pinned_host")
    w = jax.device_put(jnp.ones((4096, 4096), jnp.bfloat16))
    logits = jax.device_put(jnp.zeros((64, 32768), jnp.float32))

    def body(p, w, logits):
        x = w
        for _ in range(6):  # ~1 ms of device work ahead of the result, as a step has
            x = (x @ w) * jnp.bfloat16(1 / 64)
        bias = (p[:64].astype(jnp.float32) + x[0, :64].astype(jnp.float32) * 0)[:, None]
        return jnp.argmax(logits + bias * (jnp.arange(32768) == 7), axis=-1).astype(jnp.int32)

    f_dev = jax.jit(body)
    f_pin_in = jax.jit(lambda p, w, l: body(jax.device_put(p, on_dev), w, l), in_shardings=(on_pin, on_dev, on_dev))
    f_pin_out = jax.jit(body, out_shardings=on_pin)
    f_pin_both = jax.jit(lambda p, w, l: body(jax.device_put(p, on_dev), w, l),
                         in_shardings=(on_pin, on_dev, on_dev), out_shardings=on_pin)

    pinned = jax.device_put(np.zeros(a.size, np.int32), on_pin)
    pinned.block_until_ready()
    view = np.ctypeslib.as_array((ctypes.c_int32 * a.size).from_address(pinned.unsafe_buffer_pointer()))

    rng = np.random.default_rng(0)
    res: dict = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                          "command": " ".join(["python3 scripts/diag/host_transfer.py"] + sys.argv[1:]),
                          "device": str(dev.device_kind), "jax": jax.__version__, "complete": True},
                 "size": a.size, "n": a.n, "cases": {}}

    def run(name, call, prep, freeze=False):
        times, rts, ok = [], [], True
        if freeze:
            gc.collect()
            gc.freeze()
        for i in range(a.n + 10):
            hot = int(rng.integers(1, 1000))
            buf = np.zeros(a.size, np.int32)
            buf[:64] = 0
            buf[3] = hot  # row 3's bias makes its argmax 7; the others' 0
            t0 = time.perf_counter()
            args = prep(buf)
            t1 = time.perf_counter()
            out = call(*args)
            t2 = time.perf_counter()
            ids = np.asarray(out)
            t3 = time.perf_counter()
            ok &= bool(ids[3] == 7 and (ids[:3] == 0).all())
            if i >= 10:
                times.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        if freeze:
            gc.unfreeze()
        med = lambda k: 1e3 * sorted(t[k] for t in times)[len(times) // 2]  # noqa: E731
        res["cases"][name] = {"prep_ms": med(0), "call_ms": med(1), "wait_ms": med(2), "round_trip_ms": med(3),
                              "correct": ok}
        print(json.dumps({name: res["cases"][name]}), flush=True)

    def into_pinned(buf):
        view[:] = buf
        return (pinned, w, logits)

    for name, call, prep in [
        ("numpy_in/device_out", f_dev, lambda b: (b, w, logits)),
        ("device_put_in/device_out", f_dev, lambda b: (jax.device_put(b, on_dev), w, logits)),
        ("pinned_in/device_out", f_pin_in, into_pinned),
        ("numpy_in/pinned_out", f_pin_out, lambda b: (b, w, logits)),
        ("pinned_in/pinned_out", f_pin_both, into_pinned),
    ]:
        try:
            run(name, call, prep)
        except Exception as e:  # noqa: BLE001 - a case the backend refuses records why
            res["cases"][name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            print(json.dumps({name: res["cases"][name]}), flush=True)
    try:
        run("pinned_in/pinned_out+gc_freeze", f_pin_both, into_pinned, freeze=True)
        run("numpy_in/device_out+gc_freeze", f_dev, lambda b: (b, w, logits), freeze=True)
    except Exception as e:  # noqa: BLE001
        res["freeze_error"] = str(e)[:1500]
    # device-bound time of the body alone (10 in flight), the floor of every round trip above
    for _ in range(3):
        f_dev(np.zeros(a.size, np.int32), w, logits).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(20):
        o = f_dev(np.zeros(a.size, np.int32), w, logits)
    o.block_until_ready()
    res["back_to_back_ms"] = 1e3 * (time.perf_counter() - t0) / 20
    print(json.dumps({"back_to_back_ms": res["back_to_back_ms"]}), flush=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
