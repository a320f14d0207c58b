"""Plain-torch baselines the fused ops are measured and checked against (not the spec:
``reference.py`` is). :mod:`.original` is the original strategy module's loss math."""
