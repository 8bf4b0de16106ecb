"""The operator commands: one module per ``model-router`` subcommand (``main`` builds the parser)."""
