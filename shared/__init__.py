"""What every stage of conveyor agrees on: settings, Redis names, message schemas, the job model."""
