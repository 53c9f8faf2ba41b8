"""Pipeline execution: the eager (replay) stage runtime, p2p bundles and schedules."""
