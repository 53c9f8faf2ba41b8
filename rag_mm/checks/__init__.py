"""Checks run before any work: the config's paths and the settings that need gold documents."""
