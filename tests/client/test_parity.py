"""The sync client is the async one, blocking: the same methods with the same parameters.

``KvrouteClient`` runs ``AsyncKvrouteClient`` on a private loop; each of its methods wraps the async
method of its name (``sync.blocking``, ``sync.started``), so a parameter cannot drift apart (as
``wait_transfer``'s ``poll_interval`` once did when both were written out). A method added to the
async client and not exposed fails here.
"""

from __future__ import annotations

import inspect

from kvroute.client import AsyncKvrouteClient, KvrouteClient

LIFECYCLE = {"close"}  # both have it; the context-manager dunders differ by nature


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in LIFECYCLE
    }


def _parameters(signature: inspect.Signature) -> list[tuple[str, object, object]]:
    return [
        (parameter.name, parameter.kind, parameter.default)
        for parameter in signature.parameters.values()
    ]


def test_sync_and_async_clients_offer_the_same_methods() -> None:
    assert sorted(_public(KvrouteClient)) == sorted(_public(AsyncKvrouteClient))


def test_every_method_takes_the_same_parameters_with_the_same_defaults() -> None:
    sync, asynchronous = _public(KvrouteClient), _public(AsyncKvrouteClient)
    for name in sorted(set(sync) & set(asynchronous)):
        assert _parameters(sync[name]) == _parameters(asynchronous[name]), name


def test_constructors_take_the_same_parameters() -> None:
    assert _parameters(inspect.signature(KvrouteClient.__init__)) == _parameters(
        inspect.signature(AsyncKvrouteClient.__init__)
    )


def test_every_sync_method_wraps_the_async_method_of_its_name() -> None:
    for name in _public(KvrouteClient):
        assert getattr(KvrouteClient, name).__wrapped__ is getattr(AsyncKvrouteClient, name), name
