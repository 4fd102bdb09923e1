"""Ray runtime: connecting, placement, the job's teachers, the memory planner, preflight, the console."""
