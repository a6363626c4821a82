"""The workbench: what sits on top of the headless engine (benchmarks and the `workbench` CLI; dashboards and
traces to come). Imports of Panel stay inside the modules that need them, so the CLI starts fast."""
