"""Data: shard format, streaming IterableDatasets and samplers (issue 7; not yet implemented)."""

__all__: list[str] = []
