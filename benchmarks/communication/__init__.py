"""Bytes moved per update: pipelined model parallelism against data parallelism."""
