"""The gateway's routes, one module per OpenAI resource: completions (chat and text),
files, batches (and their output and error files), models."""
