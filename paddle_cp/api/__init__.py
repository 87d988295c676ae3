"""The front door: parallelize (one call or two), YAML configs, plan keys and checks, Paddle compatibility, lazy init."""
