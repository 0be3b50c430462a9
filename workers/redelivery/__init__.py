"""Nothing lost when a worker dies: the messages each worker holds (the in-flight ledger
and the transport's record of taken messages), the reaper that gives a dead worker's
messages back, the restore of what a worker held after a broker reconnect, and dead
letters for messages no worker can run."""
