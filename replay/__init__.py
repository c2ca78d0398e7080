"""Replay: re-send captured traffic with injected cancellations, and the reference engine it targets."""
