"""Reproductions of the ERASE paper's experiments.

One script per experiment, results in ``bench/results/paper/``; see README.md.
"""
