"""What happened to a request: metering from Envoy's access log, budgets, spans, traces, logs."""
