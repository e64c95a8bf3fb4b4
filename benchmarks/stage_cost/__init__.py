"""What one micro-batch costs inside a stage beyond its forward and backward: updates, prediction, swaps."""
