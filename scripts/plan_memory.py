#!/usr/bin/env python
"""Per-device memory plan of a model on a device mesh, from abstract shapes: ``python -m jds.bench.plan_memory``."""

from jds.bench.plan_memory import main

if __name__ == "__main__":
    main()
