"""The cost of scoring SpecTrain's predictions: training time with the probe on against off."""
