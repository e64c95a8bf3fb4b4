"""The shipped accuracy studies at their swept learning rate and at a third of it, with their reports."""
