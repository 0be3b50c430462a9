"""Where a model's files come from (sources) and the user's own registry file, layered
over config/models.yaml. The registry itself is core.registry."""
