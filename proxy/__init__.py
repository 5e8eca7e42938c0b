"""kvrelay proxy package."""
