"""Running jobs: the ``ib.generate`` and ``ib.generate_group`` tasks and what they need
while a job runs (the cancel watcher, riding out a Redis outage)."""
