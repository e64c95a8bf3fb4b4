"""Partitioners: exact min-max splits, parameter and profile balancing, plans and impossible balances."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from rayspec.data import build_data
from rayspec.errors import ConfigError
from rayspec.models import build_model
from rayspec.models._util import count_parameters
from rayspec.partition import (
    BlockProfile,
    PartitionError,
    by_parameters,
    by_profile,
    check_balance,
    choose_partition,
    min_max_split,
    profile_blocks,
    split,
    uniform,
)


def compositions(n: int, k: int):
    """Every way to write ``n`` as ``k`` positive counts, in order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def part_sums(costs, counts):
    sums, start = [], 0
    for c in counts:
        sums.append(sum(costs[start : start + c]))
        start += c
    return sums


def tie_key(costs, counts):
    """The documented order among optimal splits: squares of sums, squares of counts, then larger counts first."""
    sums = part_sums(costs, counts)
    return (max(sums), sum(s * s for s in sums), sum(c * c for c in counts), [-c for c in counts])


def random_costs(rng: random.Random, n: int, integer: bool) -> list:
    if integer:
        return [rng.choice([0, 0, 1, 2, 3, 5, 8, rng.randint(0, 100)]) for _ in range(n)]
    return [rng.choice([0.0, rng.random(), rng.uniform(0, 10), rng.expovariate(1.0)]) for _ in range(n)]


@pytest.mark.parametrize("integer", [True, False])
def test_min_max_split_matches_brute_force(integer):
    rng = random.Random(1234 + integer)
    for _ in range(400):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = random_costs(rng, n, integer)
        got = min_max_split(costs, k)
        assert len(got) == k and all(c >= 1 for c in got) and sum(got) == n, (costs, k, got)
        best = min(max(part_sums(costs, comp)) for comp in compositions(n, k))
        assert math.isclose(max(part_sums(costs, got)), best, rel_tol=1e-9, abs_tol=1e-12), (costs, k, got)
        if integer:  # exact arithmetic: the tie-breaking rule holds exactly
            assert got == min(compositions(n, k), key=lambda comp: tie_key(costs, comp)), (costs, k)


def test_min_max_split_equal_costs_is_uniform():
    for n in range(1, 10):
        for k in range(1, n + 1):
            assert min_max_split([0] * n, k) == uniform(n, k)
            assert min_max_split([3] * n, k) == uniform(n, k)
            assert min_max_split([0.25] * n, k) == uniform(n, k)


def test_min_max_split_keeps_other_stages_even():
    # the bottleneck is block 0 alone; the rest is shared out evenly, not [1, 7, 1]
    assert min_max_split([100, 1, 1, 1, 1, 1, 1, 1, 1], 3) == [1, 4, 4]


@pytest.mark.parametrize(
    "costs, stages, needle",
    [([1, -2, 3], 2, "costs[1]=-2"), ([1, float("nan")], 1, "costs[1]=nan"), ([1, "a"], 1, "costs[1]='a'"),
     ([1, 2], 3, "pipeline.stages=3"), ([1, 2], 0, "pipeline.stages=0"), ([1, 2], 1.5, "pipeline.stages=1.5")],
)
def test_min_max_split_rejects(costs, stages, needle):
    with pytest.raises(PartitionError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        min_max_split(costs, stages)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    info = build_data("synthetic_image", train_size=64, val_size=0).info
    return build_model("mlp", info, "tiny"), info


def test_by_parameters_on_mlp(mlp):
    model, _ = mlp
    per_block = [count_parameters(b) for b in model]
    for k in range(1, len(model) + 1):
        balance = by_parameters(model, k)
        check_balance(balance, len(model), k)
        sums = [count_parameters(part) for part in split(model, balance)]
        assert sum(sums) == count_parameters(model)
        assert max(sums) == min(max(part_sums(per_block, c)) for c in compositions(len(model), k))
        assert [r.parameters for r in choose_partition(model, k, "parameters").rows] == sums


def test_by_parameters_with_parameterless_blocks():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Identity(), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    for k in range(1, len(model) + 1):
        balance = by_parameters(model, k)
        assert len(balance) == k and min(balance) >= 1 and sum(balance) == len(model)


class Gate(nn.Module):
    """``x -> (linear(x), mask)``: starts a tuple with a bool mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), x[:, :5] > 0


class Masked(nn.Module):
    """``(h, mask) -> (relu(linear(h)) * mask, mask)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = x
        return torch.relu(self.fc(h)) * mask, mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = x
        return self.fc(h * mask)


def test_profile_linear_blocks_by_hand():
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    profiles = profile_blocks(model, torch.randn(4, 5), warmup=1, repeats=3)
    assert [p.parameters for p in profiles] == [5 * 7 + 7, 0, 7 * 3 + 3]
    assert [p.output_bytes for p in profiles] == [4 * 7 * 4, 4 * 7 * 4, 4 * 3 * 4]
    assert all(p.forward_s > 0 for p in profiles)
    assert profiles[0].backward_s > 0 and profiles[2].backward_s > 0


def test_profile_tuple_blocks():
    model = nn.Sequential(Gate(), Masked(), Head())
    x = torch.randn(8, 6)
    profiles = profile_blocks(model, x, warmup=1, repeats=3)
    assert [p.output_bytes for p in profiles] == [8 * 5 * 4 + 8 * 5 * 1, 8 * 5 * 4 + 8 * 5 * 1, 8 * 3 * 4]
    assert all(p.forward_s > 0 and p.backward_s > 0 for p in profiles)
    assert by_profile(model, x, 2, warmup=0, repeats=1) in ([1, 2], [2, 1])
    assert profile_blocks(model, x, warmup=0, repeats=1)[0].parameters == 6 * 5 + 5


def test_profile_leaves_the_model_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 4)
    rng = torch.get_rng_state()
    profile_blocks(model, x, warmup=1, repeats=2)
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_profile_rejects_bad_repeats():
    with pytest.raises(ValueError, match="repeats=0"):
        profile_blocks(nn.Sequential(nn.Linear(2, 2)), torch.randn(1, 2), repeats=0)


def test_plan_table_one_row_per_stage(mlp):
    model, info = mlp
    x = torch.randn(8, *info.input_shape)
    for name in ("uniform", "parameters", "profile"):
        p = choose_partition(model, 3, name, sample_input=x, device="cpu")
        lines = p.table().splitlines()
        assert len(lines) == 1 + 3 and lines[0].split()[:3] == ["stage", "blocks", "params"]
        assert [r.stage for r in p.rows] == [0, 1, 2] and sum(p.balance) == len(model)
        assert all(r.seconds > 0 for r in p.rows) and p.slowest_s == max(r.seconds for r in p.rows)
        assert p.rows[-1].output_bytes == 8 * info.num_classes * 4
        assert len(p.profiles) == len(model) and isinstance(p.profiles[0], BlockProfile)
    bare = choose_partition(model, 3, "parameters")
    assert bare.balance == by_parameters(model, 3)
    assert all(line.split()[-2:] == ["-", "-"] for line in bare.table().splitlines()[1:])
    assert choose_partition(model, 3).balance == uniform(len(model), 3)
    assert "0-2" in choose_partition(model, 3).table()
    assert choose_partition(model, 2, "profile", balance=[6, 1]).balance == [6, 1]  # balance wins, needs no sample


@pytest.mark.parametrize(
    "stages, balance, needle",
    [
        (2, [3, 3], "pipeline.balance=[3, 3]"),  # wrong sum
        (2, [0, 7], "pipeline.balance=[0, 7]"),  # a stage with no blocks
        (8, [1] * 8, "pipeline.balance=[1, 1, 1, 1, 1, 1, 1, 1]"),  # more stages than blocks
        (8, None, "pipeline.stages=8"),
        (2, [3.5, 3.5], "pipeline.balance=[3.5, 3.5]"),  # non-integers
        (2, [True, 6], "pipeline.balance=[True, 6]"),
        (3, [3, 4], "pipeline.balance=[3, 4]"),  # wrong length
    ],
)
def test_impossible_balances(mlp, stages, balance, needle):
    model, _ = mlp
    with pytest.raises(PartitionError) as err:
        choose_partition(model, stages, balance=balance)
    assert needle in str(err.value)


def test_plan_rejects_unknown_partition_and_missing_sample(mlp):
    model, _ = mlp
    with pytest.raises(ConfigError, match="'fastest'.*uniform, parameters, profile"):
        choose_partition(model, 2, "fastest")
    with pytest.raises(PartitionError, match="sample_input"):
        choose_partition(model, 2, "profile")


def test_a_profile_measured_elsewhere_replans_the_run():
    """Times measured on the stages' GPU move a ``profile`` partition; a given balance stays, with the new times."""
    from rayspec.config import from_mapping
    from rayspec.config.compose import compose
    from rayspec.training.prepare import prepare, replan

    def compose_config(*overrides):
        return compose(list(overrides))

    prepared = prepare(from_mapping(compose_config("model.size=tiny", "pipeline.stages=2", "pipeline.partition=profile")))
    n = len(prepared.model)
    slow_first = [BlockProfile(1.0 if i == 0 else 0.01, 0.0, 1, 4) for i in range(n)]
    got = replan(prepared, slow_first)
    assert got.balance == [1, n - 1] and got.plan.rows[0].seconds == 1.0
    fixed = prepare(from_mapping(compose_config("model.size=tiny", "pipeline.stages=2", "pipeline.balance=[3,4]")))
    assert replan(fixed, slow_first).balance == [3, 4]


def test_blocks_are_profiled_in_a_stage_bundle(ray_session, mlp):
    mlp, info = mlp
    """In stage 0's bundle, with its resources (no GPU here: on its CPU); the bundle is free again afterwards."""
    from ray.util.placement_group import remove_placement_group

    from rayspec.exec.ray.cluster import profile_in_bundle, reserve_stages

    group = reserve_stages(1, 0.5, 0.0)
    try:
        profiles = profile_in_bundle(mlp, torch.randn(4, *info.input_shape), group, 0, warmup=0, repeats=1)
        assert len(profiles) == len(mlp) and all(p.forward_s > 0 for p in profiles)
        assert len(profile_in_bundle(mlp, torch.randn(4, *info.input_shape), group, 0, warmup=0, repeats=1)) == len(mlp)
    finally:
        remove_placement_group(group)
