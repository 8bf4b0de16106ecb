"""The demo engine: an OpenAI/Anthropic-shaped engine for the local stack and the tests."""
