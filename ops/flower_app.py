"""The Celery app for `celery --app ops.flower_app flower` (`ib flower`, `ib up`)."""

from dispatcher.celery_app import get_app

app = get_app()
