"""Registering the interceptors however grpc lets users do it
(docs/grpc.rst, "Registering the interceptors"), by wrapping the grpc
constructors that take interceptors: :func:`patch_grpc`, which importing
``bucketimer.grpc`` calls unless ``BUCKETIMER_GRPC_PATCH=0`` is set, and
:func:`unpatch_grpc`, which restores them.

grpc.aio's ``Channel`` files each client interceptor under the first of the
four per-kind interfaces it implements (an if/elif chain), so an object
implementing all four, as bucketimer's do, would see unary-unary calls only.
The wrapped constructors act on bucketimer's interceptors only (any other
object is passed to grpc as it was given):

* a grpc.aio channel gets one single-kind adapter (:func:`split`) per kind
  a bucketimer interceptor implements, in the order given;
* a sync interceptor given to grpc.aio, or an aio one given to the sync API,
  raises a ``TypeError`` naming the class to use, when the channel or server
  is made.

Without the wrapping, ``bucketimer.grpc.aio.client_interceptors()`` does
the splitting, and grpc's own checks apply.  The wrapped functions are
grpc's private ones (:data:`TARGETS`); ``nox -s grpc-bounds`` tests them on
the oldest and the newest grpcio supported.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
import grpc.aio

from ._common import _ServerWrapper, _TimeoutRules

# -- single-kind adapters ----------------------------------------------------------------


class _Adapter:
    """One call kind of a multi-kind aio client interceptor ``inner``: its
    ``intercept_<kind>`` is the inner one's bound method, in a slot (grpc
    calls it without a frame of ours in between)."""

    __slots__ = ("inner",)
    _kind = ""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        setattr(self, f"intercept_{self._kind}", getattr(inner, f"intercept_{self._kind}"))

    def __repr__(self) -> str:
        return f"<{self._kind.replace('_', '-')} {self.inner!r}>"


def _adapter(base: type, kind: str) -> type[_Adapter]:
    # the slot, in the class's namespace, is what implements base's abstract method
    return type(f"_{kind.title().replace('_', '')}Adapter", (_Adapter, base),
                {"__slots__": (f"intercept_{kind}",), "_kind": kind})


_AIO_KINDS = [(base, _adapter(base, kind)) for base, kind in (
    (grpc.aio.UnaryUnaryClientInterceptor, "unary_unary"),
    (grpc.aio.UnaryStreamClientInterceptor, "unary_stream"),
    (grpc.aio.StreamUnaryClientInterceptor, "stream_unary"),
    (grpc.aio.StreamStreamClientInterceptor, "stream_stream"),
)]


def split(interceptor: Any) -> list[Any]:
    """``interceptor`` as grpc.aio's channel needs it: itself when it
    implements one call kind, else one adapter per kind; [] when it
    implements none."""
    kinds = [adapter for base, adapter in _AIO_KINDS if isinstance(interceptor, base)]
    if len(kinds) <= 1:
        return [interceptor] if kinds else []
    return [adapter(interceptor) for adapter in kinds]


# -- which API an interceptor is for ---------------------------------------------------------

_SYNC = "bucketimer.grpc.sync"
_AIO = "bucketimer.grpc.aio"


def _ours(interceptor: Any) -> type | None:
    """The bucketimer class ``interceptor`` is (or derives from), or None."""
    if not isinstance(interceptor, (_TimeoutRules, _ServerWrapper)):
        return None
    return next((c for c in type(interceptor).__mro__ if c.__module__ in (_SYNC, _AIO)), None)


def _public_name(module: str, name: str) -> str:
    return f"bucketimer.grpc.{name}" if module == _SYNC else f"bucketimer.grpc.aio.{name}"


def _check_api(interceptors: Sequence[Any] | None, api: str, kinds: tuple[type, ...], where: str) -> None:
    """Raise TypeError for a bucketimer interceptor of the other API that
    would be one of ``kinds`` there (what ``where`` takes, of API ``api``)."""
    for ic in interceptors or ():
        cls = _ours(ic)
        if cls is None or cls.__module__ == api or not isinstance(ic, kinds):
            continue
        other = "grpc.aio" if api == _SYNC else "the sync grpc API"
        raise TypeError(f"{_public_name(cls.__module__, cls.__name__)} is an interceptor for {other}; "
                        f"{where} takes {_public_name(api, cls.__name__)}")


_SYNC_CLIENT = (grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor)
_AIO_CLIENT = (grpc.aio.ClientInterceptor,)


def _aio_channel(interceptors: Iterable[Any] | None) -> list[Any] | None:
    if interceptors is None:
        return None
    interceptors = list(interceptors)
    _check_api(interceptors, _AIO, _SYNC_CLIENT, "a grpc.aio channel")
    out: list[Any] = []
    for ic in interceptors:
        # one that implements no client kind goes to grpc as it is (grpc refuses it)
        out.extend((split(ic) if _ours(ic) is not None else None) or (ic,))
    return out


def _aio_server(interceptors: Iterable[Any] | None) -> list[Any] | None:
    if interceptors is None:
        return None
    interceptors = list(interceptors)
    _check_api(interceptors, _AIO, (grpc.ServerInterceptor,), "grpc.aio.server()")
    return interceptors


def _sync_channel(interceptors: tuple[Any, ...]) -> tuple[Any, ...]:
    _check_api(interceptors, _SYNC, _AIO_CLIENT, "grpc.intercept_channel()")
    return interceptors


def _sync_server(interceptors: Iterable[Any] | None) -> list[Any] | None:
    if interceptors is None:
        return None
    interceptors = list(interceptors)
    _check_api(interceptors, _SYNC, (grpc.aio.ServerInterceptor,), "grpc.server()")
    return interceptors


# -- the hooks in grpc ------------------------------------------------------------------------

#: ``BUCKETIMER_GRPC_PATCH=0``: importing ``bucketimer.grpc`` wraps nothing
ENV = "BUCKETIMER_GRPC_PATCH"

#: (module, class or None, function, what its ``interceptors`` go through):
#: the grpc functions :func:`patch_grpc` wraps
TARGETS: list[tuple[str, str | None, str, Callable[[Any], Any]]] = [
    ("grpc.aio._channel", "Channel", "__init__", _aio_channel),
    ("grpc.aio._server", "Server", "__init__", _aio_server),
    ("grpc._server", "_Server", "__init__", _sync_server),
    ("grpc._interceptor", None, "intercept_channel", _sync_channel),
]

#: what :func:`patch_grpc` replaced: (owner, attribute) -> grpc's original
_originals: dict[tuple[Any, str], Any] = {}


def _hook(owner: Any, attr: str, fix: Callable[[Any], Any]) -> bool:
    """Make ``owner.attr`` (a function taking an ``interceptors`` argument)
    pass its interceptors through ``fix`` first, once.  False if grpc has
    no such function (its own checks then apply)."""
    original = getattr(owner, attr, None) if owner is not None else None
    if original is None:
        return False
    if getattr(original, "_bucketimer_fix", None) is not None:
        return True
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):  # pragma: no cover - a very different grpcio
        return False
    if "interceptors" not in signature.parameters:
        return False

    @functools.wraps(original)
    def with_interceptors(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if "interceptors" in bound.arguments:
            bound.arguments["interceptors"] = fix(bound.arguments["interceptors"])
        return original(*bound.args, **bound.kwargs)

    with_interceptors._bucketimer_fix = fix  # type: ignore[attr-defined]
    _originals[(owner, attr)] = original
    setattr(owner, attr, with_interceptors)
    return True


def patch_grpc() -> list[str]:
    """Wrap grpc's constructors that take interceptors (:data:`TARGETS`;
    see the module's doc): the names of those wrapped.  Importing
    ``bucketimer.grpc`` calls it, unless ``BUCKETIMER_GRPC_PATCH=0``;
    calling it again does nothing more.  A grpcio without one of them gets
    a ``RuntimeWarning``: its grpc.aio channels then need
    ``client_interceptors()``."""
    done, missing = [], []
    for module, owner, attr, fix in TARGETS:
        name = f"{module}.{owner + '.' if owner else ''}{attr}"
        try:
            mod = importlib.import_module(module)
        except ImportError:  # pragma: no cover - a very different grpcio
            missing.append(name)
            continue
        if _hook(mod if owner is None else getattr(mod, owner, None), attr, fix):
            done.append(name)
        else:
            missing.append(name)
    if missing:
        warnings.warn(f"bucketimer.grpc could not wrap {', '.join(missing)} in this grpcio: "
                      f"pass grpc.aio client interceptors through "
                      f"bucketimer.grpc.aio.client_interceptors()", RuntimeWarning, stacklevel=2)
    return done


def unpatch_grpc() -> None:
    """Give grpc its own constructors back (what :func:`patch_grpc` did is
    undone; channels and servers made meanwhile keep what they were given)."""
    while _originals:
        (owner, attr), original = _originals.popitem()
        setattr(owner, attr, original)


def install() -> None:
    """What importing ``bucketimer.grpc`` does: :func:`patch_grpc`, unless
    the environment says ``BUCKETIMER_GRPC_PATCH=0``."""
    if os.environ.get(ENV, "").strip() != "0":
        patch_grpc()
