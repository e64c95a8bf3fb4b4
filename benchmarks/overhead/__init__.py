"""Framework overhead: ms per hop of RayExecutor against a bare chain of Ray actor calls."""
