"""Tiny random models and a byte-level tokenizer, built offline: shared by tests, benches and docs."""
