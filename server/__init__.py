"""The OpenAI-compatible HTTP layer of `jaxllm serve`: `api` (the FastAPI app), `protocol`
(request/response schema and validation), `metrics` (Prometheus), `main` (uvicorn). The engine
core runs in a child process (`jaxllm.engine.core_proc`), reached through
`jaxllm.engine.async_llm.AsyncLLM`."""
