"""Data parallel: the optimizer parallelize returns (gradient reduction, sharding levels 1-3) and its GradScaler."""
