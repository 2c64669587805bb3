"""Running conveyor: the CLI, the local supervisor and autoscaler, model fetching, deployment manifests."""
