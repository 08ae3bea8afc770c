#!/usr/bin/env python
"""Entry point of ``python -m jds.bench.serve_modes`` (see that module for what it measures and its flags)."""

from jds.bench.serve_modes import main

if __name__ == "__main__":
    main()
