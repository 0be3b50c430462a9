"""Offline batches, OpenAI Batch JSONL in and out: ``client.batches`` (api), input lines
as jobs (format), a finished line's output or error record (records: what workers
write), and the feeder that moves staged lines into the queues with backpressure."""
