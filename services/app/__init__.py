"""The `tandem` command and its driver: the CLI, `tandem run` (embedded Ray or a cluster, the supervisor that restarts
the driver), `tandem submit` and what it uploads, export and the plot. Runs on the user's machine; may import the
orchestrator, never the other way."""
