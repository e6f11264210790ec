"""The front door's decisions: holding, refusals, remote endpoints."""
