"""kvrelay kvcache_map package."""
