"""Benchmarks for Inference Farm: each module runs with `python -m bench.<name>` and writes JSON to bench/out/."""
