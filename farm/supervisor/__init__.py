"""The processes of one farm on this machine (`farm up/serve/down/status`), one module per concern: process
primitives (`procs`), the state file (`state`), hosts and ports (`network`), the managed Redis (`redis_nodes`),
health (`health_checks`), the serve loop (`serve`) and what it prints while the farm starts (`progress`), scaling
workers (`scaling`), and `Farm` over them (`local_farm`). This surface is what callers import.
"""

from farm.supervisor.local_farm import API_APP, API_SERVER_CONFIG, Farm
from farm.supervisor.network import worker_counts
from farm.supervisor.procs import FarmError, FarmStartError, Proc, stop_ordered, tail
from farm.supervisor.state import read_state, recorded_processes, stop_from_state_file

__all__ = ["API_APP", "API_SERVER_CONFIG", "Farm", "FarmError", "FarmStartError", "Proc", "read_state",
           "recorded_processes", "stop_from_state_file", "stop_ordered", "tail", "worker_counts"]
