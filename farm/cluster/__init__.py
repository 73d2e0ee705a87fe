"""The farm's workers as every process sees them through Redis: the registry of workers and their heartbeats
(`registry`), and whether a worker is gone (`liveness`)."""
