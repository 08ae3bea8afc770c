"""Pure-JAX primitives shared by the V3.2 and V4 layers (norms, RoPE, Hadamard, FP8, paging, indexer, MQA)."""
