"""Tier 1: the refit's install batches (:func:`moeshard.plan.refit.install_batches`): consecutive
install groups that fit the staging budget together share one schedule and one agreement, so a
refit's schedules, agreements and P2P rounds do not grow with the number of layers."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.plan.refit import EngineLayout, EngineTensor, Segment, install_batches


def test_install_batches_fill_the_budget_in_order():
    group_of = np.array([-1, 0, 0, 1, 1, 2, 3])
    nbytes = np.array([10, 20, 20, 20, 20, 100, 5])
    assert install_batches(group_of, nbytes, 10**9) == ((-1, 0, 1, 2, 3),)
    assert install_batches(group_of, nbytes, 49) == ((-1,), (0,), (1,), (2,), (3,))
    assert install_batches(group_of, nbytes, 50) == ((-1, 0), (1,), (2,), (3,))
    # Group 2 is larger than the budget: alone, and the next group starts a batch.
    assert install_batches(group_of, nbytes, 90) == ((-1, 0, 1), (2,), (3,))
    assert install_batches(group_of, nbytes, 105) == ((-1, 0, 1), (2, 3))


def _plan(layers: int, staging_bytes: int):
    """A refit plan of ``layers`` row-parallel tensors (6 x 8 float32, FSDP rows over 2 trainer
    ranks), one install group each, into TP=2 bf16 engine tensors (6 x 4: 48 bytes a rank)."""
    from moeshard.ops.refit import plan_for
    from moeshard.ops.reshard import ShardLayout, TensorLayout
    from moeshard.topology import Topology

    shared = ShardLayout(
        tuple(TensorLayout(f"o{i}", (6, 8), "float32", np.arange(2), (0,)) for i in range(layers)),
        None,
        0,
        2,
        -1,
    )
    lay = EngineLayout(
        tuple(
            EngineTensor(f"o{i}", (Segment(f"o{i}"),), shard_dim=1, group=i, dtype="bfloat16") for i in range(layers)
        ),
        ranks=(0, 1),
        tp=2,
    )
    return plan_for(shared, [0, 1], lay, Topology(world_size=2, local_world_size=2), staging_bytes=staging_bytes)


@pytest.mark.parametrize("layers", [4, 12])
def test_schedules_agreements_and_rounds_do_not_grow_with_the_layers(layers):
    plan = _plan(layers, 2**20)
    assert plan.batches == (tuple(range(layers)),)
    assert len(plan.plans) == 1  # one schedule, one agreement
    assert plan.num_rounds == 1


def test_a_budget_of_two_layers_makes_batches_of_two():
    plan = _plan(4, 2 * 48)
    assert plan.batches == ((0, 1), (2, 3))
    assert len(plan.plans) == 2
    assert plan.num_rounds == 2
    # Each batch's schedule delivers only its own groups' engine tensors.
    for batch, p in zip(plan.batches, plan.plans):
        assert sorted(set(p.schedule.deliveries.param.tolist())) == list(batch)
