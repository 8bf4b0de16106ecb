"""The local stack behind ``model-router up`` and the demo engine; ``serve`` never imports this folder."""
