"""The OpenAI-compatible HTTP server over an AsyncLLM (vLLM's `vllm/entrypoints/openai/`): api_server (the FastAPI app,
/health, /metrics, /v1/models, the hold), protocol (request bodies, errors), serving_completion, serving_chat."""
