"""What both sides of the fleet share: the contract and the stores.

The job contract (jobs: GenerationJob, Selection, JobResult; errors: the typed JobErrors;
records: a batch line's output or error record), the Celery app and its queues
(celery_app) over the fleet's Redis transport (transport), models and backends
(registry, backends, drafts, models/), typed config (settings), where Redis is
(connection), the live fleet from heartbeats (fleet) and what is kept in Redis (store/).
The submitting side (dispatcher/) and the serving side (workers/) both import it; it
imports neither.
"""
