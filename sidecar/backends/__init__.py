"""The engines behind the router as seen at run time: the health/load monitor and the web search loop."""
