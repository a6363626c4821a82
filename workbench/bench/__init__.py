"""Benchmarks of the engine: `throughput` (against transformers), `prefix` (prefix caching on/off) and `profile`
(where a step's time goes). Each module has `run_<name>(...) -> dict`, `format_text` and `format_markdown`; the
submodules are imported on use, so the CLI starts without torch."""
