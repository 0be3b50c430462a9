"""Flower, the Celery dashboard: the process ``ib flower`` / ``ib up`` start (process) and
the Celery app it loads (app)."""
