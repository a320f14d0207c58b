"""An op's scalar options as one object, or as its keywords, never both: what
``DistillOptions`` (``options/distill.py``) and ``DPOOptions`` (``ops/preference.py``)
share with ``GRPOOptions`` (``options/grpo.py``)."""

import functools
import inspect
from dataclasses import fields
from typing import Callable, Optional


def options_from(given: Optional[object], keywords: dict, options_type: type):
    """``given`` (the ``options=`` keyword) or the ``options_type`` of the individual
    ``keywords``. The caller is wrapped in :func:`options_or_keywords`, which refuses a call
    giving both."""
    if given is None:
        return options_type(**keywords)
    if not isinstance(given, options_type):
        raise TypeError(f"options must be a {options_type.__name__} or None, got "
                        f"{type(given).__name__}")
    return given


def options_or_keywords(options_type: type, family: str) -> Callable[[Callable], Callable]:
    """A decorator: the function (which takes ``options`` and ``options_type``'s fields as
    parameters) refuses a call that passes ``options`` and any field, by name or by position,
    whatever the field's value: one equal to its default would otherwise be dropped without a
    word. The signature, defaults included, stays the function's. ``family`` names the options
    in the error (``"distillation"``)."""
    names = tuple(field.name for field in fields(options_type))

    def decorate(function: Callable) -> Callable:
        positional = [parameter.name
                      for parameter in inspect.signature(function).parameters.values()
                      if parameter.kind in (parameter.POSITIONAL_ONLY,
                                            parameter.POSITIONAL_OR_KEYWORD)]

        @functools.wraps(function)
        def refusing_both(*args, **kwargs):
            passed = dict(zip(positional, args), **kwargs)
            if passed.get("options") is not None:
                both = sorted(name for name in names if name in passed)
                if both:
                    raise ValueError(f"pass the {family} options either as options= or as "
                                     f"keywords, not both: {both} given beside options")
            return function(*args, **kwargs)

        return refusing_both

    return decorate
