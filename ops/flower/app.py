"""The Celery app for `celery --app ops.flower.app flower` (`ib flower`, `ib up`)."""

from core.celery_app import get_app

app = get_app()
