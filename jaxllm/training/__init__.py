"""Training here, with optax and orbax: `eagle3` (`jaxllm train-draft`), an EAGLE-3 draft head
for a model this engine serves, trained on that model's own answers."""
