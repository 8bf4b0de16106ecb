"""Envoy-facing gRPC handlers: one per ext_proc stream kind, plus the rate-limit service."""
