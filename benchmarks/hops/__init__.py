"""Where the time of one stage-to-stage hop goes on Ray, and what the workers' priority costs."""
