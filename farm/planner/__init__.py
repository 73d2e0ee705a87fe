"""The planner: watches load and latency per model and role, and sets worker replica counts.

Two policies (load-based with hysteresis, SLA-based from a measured engine profile), one guard (bounds,
cooldowns, step limits) and actuators behind one interface (local supervisor, Kubernetes, dry run).
"""
