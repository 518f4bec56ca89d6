"""Functional core: stateless models, pytree helpers, transforms, train step, checkpoints."""

__all__: list[str] = []
