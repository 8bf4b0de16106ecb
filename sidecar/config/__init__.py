"""The router config: schema and loading, cross-field rules, edits, limits and the engine table."""
