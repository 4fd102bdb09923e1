"""Alignment between teacher and student: layer maps and token/time maps."""
