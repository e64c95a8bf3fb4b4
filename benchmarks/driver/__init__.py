"""What the driver actor costs: a Ray run's loop in a driver actor against in the calling process."""
