"""What the tests share: servers they start, realistic configs, OTLP receivers, llama-server."""
