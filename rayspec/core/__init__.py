"""The pipeline's maths in plain PyTorch: methods, schedules, stages, the optimizer and SpecTrain's predictors.

Nothing here imports Ray; ``methods`` and ``schedule`` import neither torch nor Ray.
"""

__all__: list[str] = []
