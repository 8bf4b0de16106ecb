"""model-router: an Envoy external-processing sidecar for LLM traffic."""

__version__ = "0.1.0"
