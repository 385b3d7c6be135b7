"""The sync client mirrors the async one: the same methods with the same parameters.

``KvrouteClient`` runs ``AsyncKvrouteClient`` on a private loop, method by method; a parameter
added to one and forgotten in the other (as ``wait_transfer``'s ``poll_interval`` once was)
fails here.
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
