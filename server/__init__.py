"""The OpenAI-compatible HTTP layer (`jaxllm serve`). It lands with the server issue; until
then `make serve` runs an offline generation demo with the same model."""
