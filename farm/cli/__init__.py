"""The `farm` command: its parser and subcommands (`main`: `farm up/serve/down/logs/prepare/worker`), `farm
status` (`status`), and the subcommands of the Batch API (farm.batch.cli) and the planner (farm.planner.cli).
`python -m farm.cli` runs it too."""
