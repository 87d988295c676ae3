"""Expert parallelism: a MoE block's routed experts split over groups of dp x sep ranks, tokens sent to their owners and back."""
