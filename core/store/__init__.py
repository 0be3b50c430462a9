"""What the fleet keeps in Redis: job records, batches, token streams, prefix hints, and
the names of their keys (keys.py). Both sides use these: the dispatcher writes, the
workers answer."""
