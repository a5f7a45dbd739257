"""Configuration (being split into modules: for now all of it is in `engine.py`)."""

from jaxllm.config.engine import *  # noqa: F403
