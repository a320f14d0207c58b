"""An op's scalar options as one object, or as its keywords, never both: what
``DistillOptions`` (``options/distill.py``) and ``DPOOptions`` (``ops/preference.py``)
share with ``GRPOOptions`` (``options/grpo.py``)."""

import functools
import inspect
from dataclasses import fields
from typing import Any, Callable, Mapping, Optional, Tuple


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


def spread_options(options_type: type, family: str, *, positional: int = 0,
                   positional_after: Optional[str] = None,
                   renamed: Optional[Mapping[str, Tuple[str, Any]]] = None,
                   left_out: Tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """A decorator: ``function`` takes one ``options`` object (a keyword-only parameter), and
    its callers pass that as ``options=`` or as ``options_type``'s fields, one keyword each,
    from which the object is built: the public signature (``inspect.signature``, ``help``)
    lists the fields with the dataclass's defaults and annotations, written once, there.

    ``positional``: how many leading fields may also come by position, right after the
    parameter ``positional_after``. ``renamed``: ``{field: (name, default)}`` where the caller
    knows a field by another name and default (a strategy's seed names); ``left_out``: fields
    not taken (at their default). A call passing ``options`` and any field (whatever its
    value) is refused, as :func:`options_or_keywords` refuses it."""
    renamed = dict(renamed or {})

    def decorate(function: Callable) -> Callable:
        own = inspect.signature(function)
        taken = [field for field in fields(options_type) if field.name not in left_out]
        names = {renamed.get(field.name, (field.name,))[0]: field.name for field in taken}

        def parameter(field, kind):
            name, default = renamed.get(field.name, (field.name, field.default))
            return inspect.Parameter(name, kind, default=default, annotation=field.type)

        mine = [p for p in own.parameters.values() if p.name != "options"]
        ordered = [p for p in mine if p.kind is p.POSITIONAL_OR_KEYWORD]
        cut = (len(ordered) if positional_after is None
               else [p.name for p in ordered].index(positional_after) + 1)
        ordered[cut:cut] = [parameter(field, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                            for field in taken[:positional]]
        ordered += [parameter(field, inspect.Parameter.KEYWORD_ONLY)
                    for field in taken[positional:]]
        ordered += [p for p in mine if p.kind is p.KEYWORD_ONLY]
        ordered.append(inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY,
                                         default=None,
                                         annotation=Optional[options_type]))
        ordered += [p for p in mine if p.kind is p.VAR_KEYWORD]
        public = own.replace(parameters=ordered)
        defaults = {field: default for field, (_, default) in renamed.items()}

        @functools.wraps(function)
        def spread(*args, **kwargs):
            passed = public.bind(*args, **kwargs).arguments
            given = {names[name]: passed.pop(name) for name in list(passed) if name in names}
            options = passed.pop("options", None)
            if options is not None and given:
                both = sorted(name for name in names if names[name] in given)
                raise ValueError(f"pass the {family} options either as options= or as "
                                 f"keywords, not both: {both} given beside options")
            options = options_from(options, {**defaults, **given}, options_type)
            call = {}
            for p in mine:
                if p.name in passed:
                    call.update(passed[p.name] if p.kind is p.VAR_KEYWORD
                                else {p.name: passed[p.name]})
            return function(**call, options=options)

        spread.__signature__ = public
        return spread

    return decorate
