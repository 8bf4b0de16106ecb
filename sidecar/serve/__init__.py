"""The serving process: gRPC and admin servers, the runtime state, workers, restarts, gRPC auth."""
