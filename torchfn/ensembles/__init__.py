"""Ensembles: N models as one vmapped, compiled program (issue 5; not yet implemented)."""

__all__: list[str] = []
