"""A rank's class covers exactly what its peers' verdicts read: documents that share a class digest
get the same verdict against any peer, and the layout inside the slot is not part of it.

Hypothesis draws plain and hybrid worlds (tests/world.py: regions in a shuffled order with gaps,
padded slots and strides, per layout seed), optionally with a mutation that makes the generation
side incompatible. Every instance is laid out twice with other seeds, and its documents are
re-numbered (view ids, pool ids, view order) at random. Verdicts here are the first failing stage
of ``PEER_STAGES`` run on the real registrations, the checks admission and ``check_peers`` use.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvroute.geometry import GeometryError, RankRegistration
from kvroute.geometry.checks.classes import peer_verdict
from kvroute.geometry.checks.compat import PEER_STAGES
from kvroute.geometry.checks.validate import check_self
from kvroute.geometry.registration.faces import class_digest, face_digest, rank_face
from tests.unit.test_plan_ground_truth import BLOCK_TOKENS, HEAD_TOTALS, worlds
from tests.unit.test_plan_ground_truth import MUTATIONS as PLAIN_MUTATIONS
from tests.unit.test_plan_ground_truth import _mutate as plain_mutate
from tests.unit.test_plan_ground_truth_hybrid import MUTATIONS as HYBRID_MUTATIONS
from tests.unit.test_plan_ground_truth_hybrid import _mutate as hybrid_mutate
from tests.unit.test_plan_ground_truth_hybrid import hybrid_worlds
from tests.world import Side, ViewClass, instance

EXAMPLES = max(50, int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000")) // 8)
RANKS_PER_INSTANCE = (
    6  # a spread of ranks (every PP stage) keeps an example's pairs in the hundreds
)


def real_verdict(reg: RankRegistration, peer: RankRegistration) -> int | None:
    """The first stage of the existing peer checks that refuses the pair, on the registrations."""
    for index, stage in enumerate(PEER_STAGES):
        try:
            stage(reg, peer)
        except GeometryError:
            return index
    return None


def _view(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    return rng.choice(doc["views"])


def _scaled(value: int | None, rng: random.Random) -> int:
    return max(1, (value or 1) * 2 if rng.random() < 0.5 else (value or 1) // 2)


# One change each of a registration's geometry, the kind a different deployment or a mistake makes.
# Some change a verdict and some do not (a head count nobody reads); the digest must follow suit.
TWEAKS: list[Callable[[dict[str, Any], random.Random], None]] = [
    lambda doc, rng: _view(doc, rng).update(tokens_per_block=rng.choice(BLOCK_TOKENS)),
    lambda doc, rng: doc.update(tokens_per_block=rng.choice(BLOCK_TOKENS)),
    lambda doc, rng: _view(doc, rng).pop("num_kv_heads", None),
    lambda doc, rng: _view(doc, rng).update(num_kv_heads=rng.choice(HEAD_TOTALS)),
    lambda doc, rng: doc["attention"].update(num_kv_heads=rng.choice(HEAD_TOTALS)),
    lambda doc, rng: _view(doc, rng).update(total_kv_heads=rng.choice([None, *HEAD_TOTALS])),
    lambda doc, rng: _view(doc, rng).update(sliding_window=rng.choice([None, 1, 4, 9])),
    lambda doc, rng: _view(doc, rng).update(dtype=rng.choice([None, "bfloat16", "float16"])),
    lambda doc, rng: doc["attention"].update(dtype=rng.choice(["float16", "int8", "float32"])),
    lambda doc, rng: doc["attention"].update(head_dim=_scaled(doc["attention"]["head_dim"], rng)),
    lambda doc, rng: doc["attention"].update(is_mla=True),
    lambda doc, rng: (view := _view(doc, rng)).update(
        bytes_per_layer=_scaled(view["bytes_per_layer"], rng)
    ),
    lambda doc, rng: (view := _view(doc, rng)).update(
        buffers_per_layer=_scaled(view["buffers_per_layer"], rng)
    ),
    lambda doc, rng: (view := _view(doc, rng)).update(roles=[*view["roles"], "extra"]),
    lambda doc, rng: _view(doc, rng).update(kind=rng.choice(["hnd", "nhd", "replicated"])),
    lambda doc, rng: _view(doc, rng).update(per_request=True),
    lambda doc, rng: (view := _view(doc, rng)).update(layers=view["layers"][1:]),
    lambda doc, rng: _view(doc, rng).update(owner="draft"),
    lambda doc, rng: (view := _view(doc, rng)).update(
        ssm_bytes_per_head=_scaled(view.get("ssm_bytes_per_head"), rng)
    ),
    lambda doc, rng: (view := _view(doc, rng)).update(
        conv_sections=[_scaled(size, rng) for size in view.get("conv_sections", [2, 2])]
    ),
    lambda doc, rng: doc.update(num_draft_layers=doc["num_draft_layers"] + 1),
    lambda doc, rng: doc.update(tp_size=doc["tp_size"] * 2),
    lambda doc, rng: doc.update(attention_dp=True, dp_size=doc["tp_size"]),
    lambda doc, rng: doc.update(layers_per_stage=[*doc["layers_per_stage"][:-1], 99]),
    # Identity: the first peer stage reads it, so the class must cover it.
    lambda doc, rng: doc.update(model={"name": "m", "revision": rng.choice(["r1", "r2"])}),
    lambda doc, rng: doc.update(model={rng.choice(["revision", "tokenizer_digest"]): "x"}),
    lambda doc, rng: doc.update(
        kv_quantization=rng.choice(
            [{"kv_dtype": "fp8"}, {"kv_dtype": "fp8", "scale_layout": "per_tensor"}]
        )
    ),
]


def tweaked(reg: RankRegistration, rng: random.Random) -> RankRegistration | None:
    """``reg`` with one geometry change, laid out afresh; None when the result is not valid."""
    doc = reg.to_json()
    rng.choice(TWEAKS)(doc, rng)
    doc["views"] = [view for view in doc["views"] if view["layers"]]
    for pool in doc["pools"]:  # back to back: a resized region must not overlap the next
        end = 0
        for view in doc["views"]:
            if view["pool_id"] == pool["pool_id"]:
                view["layers"] = [
                    {**slot, "offset": end + i * view["bytes_per_layer"]}
                    for i, slot in enumerate(view["layers"])
                ]
                end += len(view["layers"]) * view["bytes_per_layer"]
        pool.update(slot_bytes=max(1, end), slot_stride=max(1, end))
    try:
        tweak = RankRegistration.from_json(
            doc, deployment=reg.deployment, instance=f"{reg.instance}-t", rank=reg.rank
        )
        check_self(tweak)
    except GeometryError:
        return None
    return tweak


def renamed(reg: RankRegistration, rng: random.Random) -> RankRegistration:
    """The same registration under other view and pool ids, its views listed in another order."""
    doc = reg.to_json()
    view_ids = rng.sample(range(100), len(doc["views"]))
    old_pools = [pool["pool_id"] for pool in doc["pools"]]
    pool_ids = dict(zip(old_pools, rng.sample(range(100), len(old_pools)), strict=True))
    views = [
        {**view, "view_id": view_id, "pool_id": pool_ids[view["pool_id"]]}
        for view, view_id in zip(doc["views"], view_ids, strict=True)
    ]
    rng.shuffle(views)
    pools = [{**pool, "pool_id": pool_ids[pool["pool_id"]]} for pool in doc["pools"]]
    return RankRegistration.from_json(
        {**doc, "views": views, "pools": pools},
        deployment=reg.deployment,
        instance=reg.instance,
        rank=reg.rank,
    )


@st.composite
def fleets(draw: st.DrawFn):
    """(classes, context side, generation side, generation classes, generation side as mutated)."""
    hybrid = draw(st.booleans())
    cls, ctx, gen = draw(hybrid_worlds() if hybrid else worlds())
    mutation = draw(st.sampled_from([None, *(HYBRID_MUTATIONS if hybrid else PLAIN_MUTATIONS)]))
    gen_cls, mutated = list(cls), gen
    if mutation and hybrid and (found := hybrid_mutate(mutation, cls, ctx, gen)):
        gen_cls, ctx, mutated = found[0], found[1], found[2]
        if mutation == "window":  # the context side's window changed: the unmutated side follows
            gen = replace(gen, windows=ctx.windows)
    elif mutation and not hybrid and (found := plain_mutate(mutation, cls, gen_cls, ctx, gen)):
        mutated = found[0]
    return cls, ctx, gen, gen_cls, mutated


def laid_out(
    side: Side, classes: list[ViewClass], name: str, seed: int, rng: random.Random
) -> list[RankRegistration]:
    regs, _ = instance(replace(side, seed=seed), classes, name)
    spread = regs[:: max(1, len(regs) // RANKS_PER_INSTANCE)]
    return [renamed(reg, rng) for reg in spread]


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fleet=fleets(), seeds=st.tuples(st.integers(0, 999), st.integers(1000, 1999)), data=st.data()
)
def test_documents_of_one_class_get_one_verdict_from_every_peer(fleet, seeds, data) -> None:
    cls, ctx, gen, gen_cls, mutated = fleet
    rng = random.Random(data.draw(st.integers(0, 2**32), label="renaming"))
    first, second = seeds
    contexts = laid_out(ctx, cls, "ctx-a", first, rng)
    twins = laid_out(ctx, cls, "ctx-b", second, rng)
    generations = laid_out(gen, cls, "gen-a", first, rng)
    gen_twins = laid_out(gen, cls, "gen-b", second, rng)
    others = laid_out(mutated, gen_cls, "gen-c", second, rng)
    # The same geometry laid out and numbered otherwise is the same class.
    for a, b in [*zip(contexts, twins, strict=True), *zip(generations, gen_twins, strict=True)]:
        assert a.class_digest == b.class_digest
    by_role = {"context": contexts + twins, "generation": generations + gen_twins + others}
    for role, regs in list(by_role.items()):  # geometry changed one field at a time
        changed = [tweaked(reg, rng) for reg in regs for _ in range(2)]
        by_role[role] = regs + [reg for reg in changed if reg is not None]
    every = by_role["context"] + by_role["generation"]
    verdicts = defaultdict(set)  # (class, peer) -> the verdicts of the class's documents
    for reg in every:
        peers = by_role["generation" if reg.role.value == "context" else "context"]
        for index, peer in enumerate(peers):
            verdict = real_verdict(reg, peer)
            assert peer_verdict(reg, peer) == verdict  # memoized verdicts are judged on faces
            verdicts[reg.class_digest, reg.role, index].add(verdict)
            event(f"verdict {verdict}")
    assert all(len(seen) == 1 for seen in verdicts.values()), {
        key: seen for key, seen in verdicts.items() if len(seen) > 1
    }


def test_the_layout_is_outside_the_class_and_the_geometry_inside() -> None:
    kv = [ViewClass(("key", "value"), "target", "hnd", 8, 2, 16)]
    side = Side("context", tp_size=2, layers_per_stage=(4, 4), tokens_per_block=4)
    (a, *_), (b, *_) = instance(side, kv, "x")[0], instance(replace(side, seed=7), kv, "y")[0]
    assert a.views[0].offsets != b.views[0].offsets  # shuffled order, gaps
    assert a.class_digest == b.class_digest
    for changed in (
        replace(side, head_dim=16),
        replace(side, tokens_per_block=8),
        replace(side, layers_per_stage=(3, 5)),
        replace(side, windows=((0, 64),)),
    ):
        assert instance(changed, kv, "x")[0][0].class_digest != a.class_digest
    wider = [replace(kv[0], unit=32)]
    assert instance(side, wider, "x")[0][0].class_digest != a.class_digest


def test_a_check_reading_the_layout_cannot_run_on_a_face() -> None:
    kv = [ViewClass(("key", "value"), "target", "hnd", 8, 2, 16)]
    reg = instance(Side("context", tp_size=2, layers_per_stage=(4,)), kv, "x")[0][0]
    face = rank_face(reg)
    for view_member in ("offsets", "layers", "pool_id", "num_kv_heads", "per_request"):
        with pytest.raises(AttributeError):
            getattr(face.views[0], view_member)
    for rank_member in ("pools", "tp_rank", "dp_rank", "pp_rank", "tokens_per_block"):
        with pytest.raises(AttributeError):
            getattr(face, rank_member)
    assert face_digest(face) == class_digest(reg) == reg.class_digest


def test_a_face_member_without_a_canonical_form_is_refused() -> None:
    kv = [ViewClass(("key", "value"), "target", "hnd", 8, 2, 16)]
    face = rank_face(instance(Side("context", tp_size=1, layers_per_stage=(2,)), kv, "x")[0][0])
    odd = replace(face, views=(replace(face.views[0], conv_sections=[1, 2]),))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list"):
        face_digest(odd)
