"""Inference workers: a continuous-batching engine fed from the `tokenized` stream, and an output lane."""
