"""repmlp.bench.throughput."""
