"""Every ``ib:*`` Redis key the fleet writes, named in one place (docs/operations.md lists them).

Celery's own keys (the queues ``ib.<backend>[.<worker>][:<priority>]``, kombu's unacked
set and bindings) are named by core.celery_app and kombu, not here.
"""

from __future__ import annotations

# ---------------------------------------------------------------- jobs (core.store.jobstore)


def job(job_id: str) -> str:
    """Hash: status, attempts, worker, the one final result or error."""
    return f"ib:job:{job_id}"


def cancel(job_or_batch_id: str) -> str:
    """A cancel flag for a job, or for every line of a batch (its id is their scope)."""
    return f"ib:cancel:{job_or_batch_id}"


CANCELS = "ib:cancels"  # pub/sub channel: every cancel announces the flagged id, workers then read their flags


def done(job_id: str) -> str:
    """A one-token list pushed when the job finishes: what waiting clients BLPOP on."""
    return f"ib:done:{job_id}"


def stream(job_id: str) -> str:
    """The text deltas of a job submitted with ``stream=True``, then an end entry."""
    return f"ib:stream:{job_id}"


# ---------------------------------------------------------------- batches (core.store.batchstore)

BATCHES = "ib:batches"  # sorted set: every batch by creation time
BATCH_PURGES = "ib:batches:purge"  # sorted set: every batch (and its owner) by the time its records expire
ACTIVE_BATCHES = "ib:batches:active"  # sorted set: batches the feeder still has to look at
FEEDER_LEASE = "ib:batch-feeder"  # which feeder feeds (one at a time in the fleet)


def batch(batch_id: str) -> str:
    """Hash: status, timestamps, request counts, the feed cursor."""
    return f"ib:batch:{batch_id}"


def batch_lines(batch_id: str) -> str:
    """List: the valid lines as jobs, in input order."""
    return f"ib:batch:{batch_id}:lines"


def batch_out(batch_id: str) -> str:
    """Hash: line number → its output or error record, written once."""
    return f"ib:batch:{batch_id}:out"


# ---------------------------------------------------------------- the fleet (core.fleet, workers)

WORKERS = "ib:workers"  # set: ids of workers that have beaten (the dead are reaped from it)
# counter: bumped whenever a worker joins, leaves or changes what a decision reads of it
# (core.fleet.WorkerInfo.shape), so a client can tell its cached view still holds
FLEET_EPOCH = "ib:fleet:epoch"
WORKER_QUEUES = "ib:worker-queues"  # hash: worker id → its own queue (kept a while after it dies)
ORPHANED = "ib:orphaned"  # sorted set: dead workers whose own queue is swept, by time of death
DEAD_LETTERS = "ib:dead-letters"  # hash: letter id → a message no worker could run (store.dead_letters)
DEAD_LETTER_INDEX = "ib:dead-letters:index"  # sorted set: letter ids by time
DEAD_LETTER_BYTES = "ib:dead-letters:bytes"  # integer: the letters' total size, for the byte cap
UNTRACKED_SWEEP = "ib:untracked-sweep"  # which worker sweeps the broker's unacked set this round


def worker(worker_id: str) -> str:
    """A worker's heartbeat (its WorkerInfo as JSON, with a TTL)."""
    return f"ib:worker:{worker_id}"


def inflight(worker_id: str) -> str:
    """Hash: task id → broker delivery tag of every message a worker has reserved."""
    return f"ib:inflight:{worker_id}"


def reap_lock(worker_id: str) -> str:
    """Held by the live worker that redelivers a dead one's jobs."""
    return f"ib:reap-lock:{worker_id}"


# ---------------------------------------------------------------- prefix hints (core.store.hints)


def prefix_block(block_hash: str) -> str:
    """Sorted set: worker id → last time it held this KV block."""
    return f"ib:prefix:{block_hash}"


def worker_blocks(worker_id: str) -> str:
    """Sorted set: the block hashes a worker was said to hold, by time (capped; dropped when
    it dies or restarts)."""
    return f"ib:prefix-blocks:{worker_id}"


# ---------------------------------------------------------------- the HTTP gateway (gateway/)


def file(file_id: str) -> str:
    """Hash: an uploaded file's metadata (owner, name, bytes, where its bytes are stored)."""
    return f"ib:file:{file_id}"


FILE_EXPIRY = "ib:file-expiry"
"""Sorted set: uploaded file ids by the time they expire (gateway.files prunes their bytes)."""


def owner_file_usage(owner: str) -> str:
    """Hash: an API key's uploaded files and bytes, for its quota (gateway.files)."""
    return f"ib:file-usage:{owner}"


def owner_files(owner: str) -> str:
    """Sorted set: an API key's files by creation time."""
    return f"ib:files:{owner}"


def owner_batches(owner: str) -> str:
    """Sorted set: an API key's batches by creation time."""
    return f"ib:batches:owner:{owner}"


def owner_inflight(owner: str) -> str:
    """Sorted set: an API key's interactive jobs queued or running, scored by their deadline."""
    return f"ib:gateway-inflight:{owner}"
