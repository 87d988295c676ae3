"""The front door: `parallelize` and its config (YAML), plan-key matching and the whole-plan checks."""
