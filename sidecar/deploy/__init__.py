"""Generators of Envoy and Kubernetes configuration from a router config."""
