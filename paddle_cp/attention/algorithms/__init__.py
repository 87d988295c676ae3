"""The context-parallel algorithms: ring (with its k/v rotations), Ulysses, state passing, run windows, the merge."""
