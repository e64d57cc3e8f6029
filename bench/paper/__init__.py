"""Reproductions of the ERASE paper's experiments: one script per experiment, results in bench/results/paper/."""
