"""Weight memory per stage: PipeDream's weight stash against SpecTrain's one scratch copy."""
