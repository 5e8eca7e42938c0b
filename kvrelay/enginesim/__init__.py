"""kvrelay enginesim package."""
