"""The training components the loop uses: checkpointing, the optimizer and schedule, the non-finite
guard, metrics logging."""
