"""Recovery from a dead stage or driver actor: detection and restart times, updates lost."""
