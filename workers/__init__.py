"""CPU workers: the tokenizer pool and the Celery app for after-job and upkeep work."""
