"""`ib bench profiles`: each live backend measured on one workload (bench) and the table
written into docs/BENCHMARKS.md (docs)."""
