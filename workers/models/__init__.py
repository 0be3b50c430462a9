"""The serving side's knowledge of model files: what a model is (facts), which engines
can run it (support), and deriving the formats it lacks (prepare)."""
