"""The submitting side of InferenceBackend: where a job goes and how it gets there.

The Python client (client: a thin facade over parts), the router that decides (router,
routing/: pure, handed the fleet view), what it reads of the fleet (fleet_state), the
sender that claims records and publishes (sender, push_guard, messages, grouping), and
offline batches (batch/). It imports core/ for the contract and the stores; it never
imports workers/, gateway/ or ops/.
"""
