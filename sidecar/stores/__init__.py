"""Shared state outside the process: the response cache and the Redis store."""
