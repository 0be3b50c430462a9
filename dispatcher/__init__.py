"""The submitting side of InferenceBackend: job contract, decision tree, registry, client."""
