"""Integrations with real engines: each makes an engine's own ranks WeightSync participants."""
