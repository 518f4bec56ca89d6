"""Meta-learning: MAML, first-order MAML, ANIL, Meta-SGD, Reptile (issue 6; not yet implemented)."""

__all__: list[str] = []
