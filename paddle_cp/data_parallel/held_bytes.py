"""A rank's bytes of one kind held now and the most held at once, counted from shapes as they come and go (no
allocator read): fetched parameter copies at sharding level 3, gradients waiting for their reduction."""


class HeldBytes:
    def __init__(self):
        self.held = self.peak = 0

    def add(self, nbytes):
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def reset_peak(self):
        self.peak = self.held
