"""kvrelay connector package."""
