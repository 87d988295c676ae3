"""Which tokens live on which rank: the sequence layout chosen per batch, its plans and planned exchanges."""
