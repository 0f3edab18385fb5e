"""Benchmarks that compile the real train step: `sharding_bench` compares mesh layouts with numbers.

Pure parsing and bookkeeping (`hlo`, `flops`, `synthetic`) import no jax; `sharding_bench` and `peak`
touch devices.
"""
