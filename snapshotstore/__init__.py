"""KV-delta persistence on block devices, the NVMe-oF way (see issue: snapshot store)."""
