"""Benchmarks of the engine: `throughput` (against transformers), `prefix` (prefix caching on/off), `profile`
(where a step's time goes), `serve` (online serving metrics), `sweep` (the token budget), `guided` (the cost of
grammar masks), `roofline` (against the machine's limits), `spec` (speculative decoding), `pd` (disaggregated
prefill/decode), `parallel` (tensor parallelism), `dp_routing` (data parallelism: routing by load vs by
cached prefix), `kernels` (Triton, CUDA only) and `gains` (a table from the
others' kept results).

Each module owns its command line, as vLLM's `vllm/benchmarks/serve.py` does: `add_cli_args(parser)` adds its flags
(the shared ones from `args.add_common_args`), `main(args)` runs `run_<name>(...)` with them and returns its
result, and `format_text(result)` / `format_markdown(result, command)` (from `report.formatters`) report it. A
module-level `HELP` (else the docstring's first line) is its help and `IN_ALL = (place, flags)` puts it in
`workbench bench all`. `workbench.cli` finds such modules by reading their source, so adding a benchmark is adding
its module; the submodules are imported on use, so the CLI starts without torch."""
