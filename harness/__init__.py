"""What tests and benchmarks both need to drive conveyor from outside: start and stop a whole stack
(`harness.stack`), read a job's SSE stream (`harness.sse`), and build a tiny model (`harness.models`)."""
