"""Topology domains: where a rank runs, and which context instances a generation instance pairs with.

A rank may declare the domains it runs in, ``"topology": {"zone": "us-east-1a", "rack": "r12",
"nvlink_domain": "nvl72-3"}`` (names and values are the operator's). Domains never change a
verdict or a plan, so they stay out of the face, the class and the geometry digest; they order and
restrict pairs under the deployment's pairing policy: ``require`` (domains a pair must share) and
``prefer`` (domains in decreasing importance: sharing the first outranks sharing all the others).

An instance is *in* a value of a domain when every one of its live ranks declares that value. An
instance whose ranks declare several values (spanning racks) or that some rank leaves undeclared
is in no single value, so it shares that domain with nobody: a pair "within a rack" must have
every byte move inside the rack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.limits import MAX_DOMAINS

if TYPE_CHECKING:
    from kvroute.geometry.registration.document import _Reader
    from kvroute.geometry.registration.model import RankRegistration

DOMAIN_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}", re.ASCII)
VALUE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}", re.ASCII)
REQUIRED = "topology_domain_required"

Topology = tuple[tuple[str, str], ...]  # (domain, value), sorted by domain


def _invalid(field: str, detail: str, value: Any = None) -> GeometryError:
    return GeometryError(
        "invalid_document", f"{field}: {detail}", field=field, local=value, stage="schema"
    )


def parse_topology(r: _Reader) -> dict[str, Any]:
    """The ``topology`` member as a RankRegistration field ({} when absent)."""
    if not r.has("topology"):
        return {}
    raw = r.obj["topology"]
    if not isinstance(raw, Mapping) or not 1 <= len(raw) <= MAX_DOMAINS:
        raise _invalid("topology", f"must be an object of 1..{MAX_DOMAINS} domains")
    for domain, value in raw.items():
        if not isinstance(domain, str) or not DOMAIN_PATTERN.fullmatch(domain):
            raise _invalid("topology", f"{domain!r} is not a domain name", str(domain)[:40])
        if not isinstance(value, str) or not VALUE_PATTERN.fullmatch(value):
            raise _invalid(f"topology.{domain}", f"{value!r} is not a domain value", value)
    return {"topology": tuple(sorted(raw.items()))}


def render_topology(reg: RankRegistration) -> dict[str, Any]:
    return {"topology": dict(reg.topology)} if reg.topology else {}


@dataclass(frozen=True, slots=True)
class PairingPolicy:
    require: tuple[str, ...] = ()
    prefer: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, doc: Mapping[str, Any] | None) -> PairingPolicy:
        """A policy document (``{"require": [...], "prefer": [...]}``); None is no policy."""
        if doc is None:
            return cls()
        lists = {}
        for key in ("require", "prefer"):
            names = doc.get(key, [])
            if not isinstance(names, list) or len(names) > MAX_DOMAINS:
                raise _invalid(f"pairing.{key}", f"must be a list of at most {MAX_DOMAINS} domains")
            for index, name in enumerate(names):
                if not isinstance(name, str) or not DOMAIN_PATTERN.fullmatch(name):
                    raise _invalid(f"pairing.{key}[{index}]", "is not a domain name", name)
            if len(set(names)) != len(names):
                raise _invalid(f"pairing.{key}", "names a domain twice", names)
            lists[key] = tuple(names)
        both = sorted(set(lists["require"]) & set(lists["prefer"]))
        if both:
            raise _invalid("pairing.prefer", f"{both[0]} is required already", both[0])
        return cls(**lists)

    def to_json(self) -> dict[str, list[str]]:
        return {"require": list(self.require), "prefer": list(self.prefer)}

    @property
    def empty(self) -> bool:
        return not (self.require or self.prefer)


DomainValue = str | list[str] | None  # the single value; the values of a split instance; none


def instance_domains(topologies: Iterable[Topology]) -> dict[str, DomainValue]:
    """Domain -> the value every rank declares; the sorted values when ranks differ, None when a
    rank declares none."""
    ranks = [dict(topology) for topology in topologies]
    domains = sorted({domain for rank in ranks for domain in rank})
    found: dict[str, DomainValue] = {}
    for domain in domains:
        values = [rank.get(domain) for rank in ranks]
        distinct = sorted({value for value in values if value is not None})
        found[domain] = None if None in values else distinct[0] if len(distinct) == 1 else distinct
    return found


def shared_domains(mine: Mapping[str, DomainValue], theirs: Mapping[str, DomainValue]) -> list[str]:
    """Domains both instances lie wholly inside, with the same value."""
    return sorted(
        domain
        for domain, value in mine.items()
        if isinstance(value, str) and theirs.get(domain) == value
    )


def required_exclusion(
    policy: PairingPolicy,
    generation: tuple[str, Mapping[str, DomainValue]],
    context: tuple[str, Mapping[str, DomainValue]],
) -> dict[str, Any] | None:
    """The first required domain the pair does not share, as a refusal (None: none missing)."""
    (gen_name, mine), (ctx_name, theirs) = generation, context
    shared = shared_domains(mine, theirs)
    for domain in policy.require:
        if domain not in shared:
            local, peer = mine.get(domain), theirs.get(domain)
            return {
                "code": REQUIRED,
                "field": f"topology.{domain}",
                "local": local,
                "peer": peer,
                "detail": f"the deployment requires pairs within one {domain}: {gen_name} is in "
                f"{_where(local)}, {ctx_name} in {_where(peer)}",
            }
    return None


def preference_key(
    policy: PairingPolicy, mine: Mapping[str, DomainValue], theirs: Mapping[str, DomainValue]
) -> tuple[int, ...]:
    """Sorts better pairs first: sharing an earlier preferred domain outranks all later ones."""
    shared = set(shared_domains(mine, theirs))
    return tuple(0 if domain in shared else 1 for domain in policy.prefer)


def _where(value: DomainValue) -> str:
    if value is None:
        return "none declared by every rank"
    return value if isinstance(value, str) else f"several ({', '.join(value)})"
