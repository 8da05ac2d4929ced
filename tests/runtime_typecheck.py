"""The typechecker the test suite runs hookmech under (tests/conftest.py installs it).

`install_import_hook` ("hookmech") installs jaxtyping's import hook with `typechecked`: every
function and method of hookmech (and every dataclass's ``__init__``) is decorated with
``@jaxtyped(typechecker=typechecked)`` as its module is imported. At each call jaxtyping opens
a shape memo (a dimension name is one size across the parameters and the return value), checks
the arguments with one function `typechecked` made of the signature, calls the function, then
checks the return value with another; on a failure it names the parameter, its value
(``i64[3](torch)``), the expected type and the sizes bound so far.

Why not ``"typeguard.typechecked"`` itself: jaxtyping hands the typechecker functions it
generated with ``exec`` (the signature, annotations evaluated), and typeguard 4 instruments a
function by re-reading its module's source, where those are not: it warns
``InstrumentationWarning: instrumentor did not find the target function -- not typechecking``
and checks nothing. So the checks here are typeguard's checking function
(`typeguard.check_type_internal`, every item of a collection checked, not only the first),
applied to each annotated parameter and to the return value.

Not checked: functions defined inside functions (closures are internal helpers, never public
boundaries, and jaxtyping would re-decorate one at every call of its parent, about 0.4 ms each:
building a small model took 9x as long through `HookedLM._init_weights`'s `reinit`); an
annotation jaxtyping cannot evaluate in the module's globals (a name imported under
TYPE_CHECKING, a class local to a function) becomes `Any`; a parameter left at its default
(as typeguard); what a generator yields, what an iterator holds.
"""
from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any

import jaxtyping
from jaxtyping import _import_hook
from typeguard import (
    CollectionCheckStrategy,
    TypeCheckConfiguration,
    TypeCheckError,
    TypeCheckMemo,
    check_type_internal,
)

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
_VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD

# Every item of a list/dict/tuple, not the first only (typeguard's default): a Batch's roles,
# a mixer's context are dicts of tensors whose every value carries a shape.
_CONFIG = TypeCheckConfiguration(collection_check_strategy=CollectionCheckStrategy.ALL_ITEMS)


def install_import_hook(package: str) -> None:
    """Check every module of `package` imported from now on: jaxtyping's import hook with
    `typechecked`, on module-level functions, methods and dataclasses (not on nested functions).

    jaxtyping keeps the instrumented bytecode in ``__pycache__`` under a tag made of the
    typechecker's name ("runtime_typecheck.typechecked"), not of what is instrumented: after
    changing `_TopLevelTransformer`, delete ``__pycache__/*.opt-jaxtyping*.pyc``."""
    _import_hook.JaxtypingTransformer = _TopLevelTransformer
    jaxtyping.install_import_hook(package, "runtime_typecheck.typechecked")


class _TopLevelTransformer(_import_hook.JaxtypingTransformer):
    """jaxtyping's transformer (private: jaxtyping/_import_hook.py, the same since 0.2.28), less
    the functions defined inside functions."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        if any(isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) for parent in self._parents):
            return node  # and whatever it defines in turn
        return super().visit_FunctionDef(node)


def typechecked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Return `fn` checking its annotated arguments with typeguard, or only its return value
    when it has a return annotation; `fn` itself when there is nothing to check.

    jaxtyping calls the parameters' checker before the function and the return value's
    (which also takes all the parameters) after it, in the same shape memo: the parameters
    were checked by then, so the second checks the return value only."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    returns = signature.return_annotation
    self_name = params[0].name if params and params[0].kind in _POSITIONAL and params[0].name in ("self", "cls") else None
    if returns not in (_EMPTY, Any):
        return _checking_return(fn, returns, self_name)
    checks = {p.name: _checker(p.annotation) for p in params if p.annotation not in (_EMPTY, Any)}
    if not checks:
        return fn
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    var_positional = next((p.name for p in params if p.kind is _VAR_POSITIONAL), None)
    by_keyword = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    var_keyword = next((p.name for p in params if p.kind is _VAR_KEYWORD), None)

    def checked(*args: Any, **kwargs: Any) -> Any:
        memo = _memo(self_name, args, kwargs)
        for index, value in enumerate(args):
            name = positional[index] if index < len(positional) else var_positional
            if name in checks:
                checks[name](value, memo, name)
        for name, value in kwargs.items():
            target = name if name in by_keyword else var_keyword
            if target in checks:
                checks[target](value, memo, name)
        return fn(*args, **kwargs)

    return checked


def _checking_return(fn: Callable[..., Any], returns: Any, self_name: str | None) -> Callable[..., Any]:
    check = _checker(returns)

    def checked(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        check(out, _memo(self_name, args, kwargs), None)
        return out

    return checked


def _memo(self_name: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TypeCheckMemo:
    """typeguard's memo; `Self` is the class of the call's first argument ("self"; "cls" itself)."""
    self_type = None
    if self_name is not None:
        first = args[0] if args else kwargs.get(self_name)
        self_type = first if self_name == "cls" else type(first)
    return TypeCheckMemo({}, {}, self_type=self_type, config=_CONFIG)


def _checker(annotation: Any) -> Callable[[Any, TypeCheckMemo, str | None], None]:
    """Return ``check(value, memo, parameter name or None for the return value)``.

    A plain class (a jaxtyping shape included) is checked with `isinstance` first: a value
    that passes passes typeguard's check too; one that does not goes to typeguard, which
    accepts what PEP 484 allows (an int for a float) and words the error. A runtime-checkable
    Protocol (the engine's `PatchableModel`) is left to the library, which checks it itself and
    names what is missing (`hookmech.patching.protocol.check_patchable`, tested): typeguard
    would also compare each method's signature with the protocol's, which writes
    TransformerLens's methods loosely (``*args, **kwargs``) on purpose."""
    fast = isinstance(annotation, type) and not getattr(annotation, "_is_protocol", False)
    runtime_protocol = isinstance(annotation, type) and getattr(annotation, "_is_runtime_protocol", False)

    def check(value: Any, memo: TypeCheckMemo, name: str | None) -> None:
        if fast and isinstance(value, annotation):
            return
        if runtime_protocol:
            return
        try:
            check_type_internal(value, annotation, memo)
        except TypeCheckError as error:
            what = "the return value" if name is None else f'argument "{name}"'
            error.append_path_element(f"{what} ({type(value).__qualname__})")
            raise

    return check
