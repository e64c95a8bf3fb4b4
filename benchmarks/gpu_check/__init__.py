"""GPU check: every transport and method the GPUs allow equals the local executor; samples/s, memory."""
