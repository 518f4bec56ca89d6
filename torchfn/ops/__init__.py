"""Custom C++/CUDA ops with pure-PyTorch reference twins (issue 3; not yet implemented)."""

__all__: list[str] = []
