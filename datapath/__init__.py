"""zerolayer's data path: wire codec, topology, BPF loading, orchestration and CLI."""
