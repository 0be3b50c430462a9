"""The serving side of InferenceBackend: Celery workers that each load one engine."""
