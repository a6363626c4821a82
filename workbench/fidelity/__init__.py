"""`workbench fidelity`: this engine checked against vLLM 0.33.0's own scheduler and KV cache manager, decision for
decision. workload.py draws seeded workloads; engine_side.py runs one through this engine (the scripted executor);
tests/fidelity/vllm_driver.py runs the same through vLLM in its own venv (`make vllm-ref`); compare.py finds the
first step where they part; command.py is the command (`run`, `record`, `check`); docs/FIDELITY.md has the results.
"""
