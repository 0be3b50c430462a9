"""Benchmarks: each runs as a module from the repository root (`python -m bench.cpu_backends`, or the
Makefile's `make bench-*`) and writes its JSON through bench.report."""
