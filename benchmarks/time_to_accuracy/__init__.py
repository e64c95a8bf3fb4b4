"""Which method reaches 95 % and 99 % of the sequential baseline's accuracy first, in training seconds, on a study?"""
