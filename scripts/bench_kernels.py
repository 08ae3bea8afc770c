#!/usr/bin/env python
"""Entry point of ``python -m jds.bench.kernels`` (see that module for what it measures and its flags)."""

from jds.bench.kernels import main

if __name__ == "__main__":
    main()
