"""Offline batches, OpenAI Batch JSONL in and out: ``client.batches`` (api), the line
format both ways (format), and the feeder that moves staged lines into the queues with
backpressure (feeder)."""
