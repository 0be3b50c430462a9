"""Where a job goes: the seed's decision tree and its hard constraints (decision), prefix
affinity's block hashes (prefix), and the measured profiles the ``profile`` policy reads
(profiles). Only the submitting side uses it; workers never import it."""
