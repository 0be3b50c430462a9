"""Offline batches, OpenAI Batch JSONL in and out: ``client.batches`` (api), the batch as
the API shows it (objects), a file read, validated and staged (staging, input, format),
the feeder that moves staged lines into the queues with backpressure (feeder), and the
lines a dying worker took with it (lost_lines). A line's output or error record is
core.records: the workers write it."""
