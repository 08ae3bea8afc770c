#!/usr/bin/env python
"""Entry point of ``python -m jds.bench.boundary`` (see that module for what it measures and its flags)."""

from jds.bench.boundary import main

if __name__ == "__main__":
    main()
