"""The ops' scalar options as objects (``GRPOOptions``, ``DistillOptions``), the GRPO loss-type
records, and the checks of one scalar: below both the spec (``reference.py``) and the ops, which
import them; this package imports neither."""
