"""The ``ib`` commands, one module per command group (as Celery's ``celery/bin/``); they
never import each other: what they share is ops.console. ops.cli puts them together."""
