"""Data parallel: gradient reduction over replicas, sharding levels 1-3, level-3 parameter fetch."""
