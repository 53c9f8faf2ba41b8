"""Fault tolerance: disk space, injected faults, preemption (SIGTERM), the collective watchdog."""
