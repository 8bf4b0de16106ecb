"""Reading and editing request and response bodies (JSON, SSE, multipart forms)."""
