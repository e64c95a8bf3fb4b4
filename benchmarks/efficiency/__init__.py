"""Pipeline efficiency: ideal schedule makespan over measured time, sleep-timed stages and real compute."""
