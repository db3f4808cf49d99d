"""Carrying decisions out: the actuator (every Slurm step recorded before and after) and notifications."""
