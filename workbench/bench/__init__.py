"""Benchmarks of the engine: `throughput` (against transformers), `prefix` (prefix caching on/off), `profile`
(where a step's time goes), `serve` (online serving metrics), `sweep` (the token budget), `guided` (the cost of
grammar masks), `roofline` (against the machine's limits), `spec` (speculative decoding) and `kernels` (Triton,
CUDA only). Each module has `run_<name>(...) -> dict`, `format_text` and `format_markdown`; the submodules are
imported on use, so the CLI starts without torch."""
