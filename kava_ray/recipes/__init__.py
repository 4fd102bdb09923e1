"""Runs: the distillation recipe (Ray Train loop), the train and Tune drivers, evaluation, reports."""
