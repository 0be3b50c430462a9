"""The contract and the submitting side of InferenceBackend.

The contract both sides share: the task message (jobs: GenerationJob, Selection,
JobResult, typed errors), the Celery app and its queues (celery_app), models and backends
(registry, drafts), typed config (settings), where Redis is (connection), the live fleet
from heartbeats (fleet) and what is kept in Redis (store/). The submitting side: the
Python client (client), where a job goes (routing/) and offline batches (batch/).
It never imports workers/ or ops/; workers/ imports only the contract from here.
"""
