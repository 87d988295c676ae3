"""Adapters that run the training tools users already have (PaddleFormers' Trainer) on paddle_cp."""
