"""Tools over the library: the CLI, the planner and presets, trace files, OpenTelemetry set-up."""
