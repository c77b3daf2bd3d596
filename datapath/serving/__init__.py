"""The serving side: the model, KV deltas, simulated devices and the worker."""
