#!/usr/bin/env python
"""Entry point of ``python -m jds.bench.probe_graph_updates`` (see that module for what it measures and its flags)."""

from jds.bench.probe_graph_updates import main

if __name__ == "__main__":
    main()
