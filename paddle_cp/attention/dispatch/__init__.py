"""From an attention call to the algorithms: entry points, routing under ContextParallel, groups, checks, the batch."""
