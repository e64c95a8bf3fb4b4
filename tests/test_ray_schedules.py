"""On Ray's p2p transport the synchronous schedules (1F1B, ZB-H1's I and W) and PipeDream-2BW equal the local
executor, and the synchronous ones SGD; what stage actors cannot run is refused with the fix. Interleaved 1F1B (model
chunks per actor): test_ray_interleaved."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, make_stages, microbatches, plain_sgd

from rayspec.core.methods import METHODS
from rayspec.core.schedule import ScheduleError, build_schedule
from rayspec.errors import ConfigError
from rayspec.exec import LocalExecutor
from rayspec.exec.ray import RayExecutor

UPDATES = 4


def _run(ex, model, data, method, n, group):
    stages = make_stages(model, method, n, group=group)
    schedule = build_schedule(METHODS[method].schedule, n, UPDATES * group, group=group)
    if ex is None:
        ex = LocalExecutor(stages, method)
    else:
        ex.load(stages)
        ex.method = method
    losses = ex.run(schedule, iter(microbatches(data, UPDATES, 32, group)))
    return ex.state_dict(), losses


@pytest.fixture(scope="module", params=[2, 4])
def p2p(request, ray_session, tiny):
    """Stage actors on p2p in chunks of 3 micro-batches, so that the schedules cross from chunk to chunk."""
    ex = RayExecutor(make_stages(tiny[0], "1f1b", request.param), "1f1b", transport="p2p", cpus_per_stage=0.5,
                     chunk=3)
    yield ex, request.param
    ex.close()


@pytest.mark.slow
@pytest.mark.parametrize("method,group", [("1f1b", 4), ("zb1p", 4), ("pipedream-2bw", 4)])
def test_p2p_equals_local(p2p, tiny, method, group):
    ex, n = p2p
    model, data = tiny
    got, losses = _run(ex, model, data, method, n, group)
    want, want_losses = _run(None, model, data, method, n, group)
    assert_same_weights(got, want)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    if METHODS[method].flushes:
        assert_same_weights(got, plain_sgd(model, data, UPDATES, 32))
    if method == "zb1p":
        assert all(st["actions"]["I"] == st["actions"]["W"] == UPDATES * group for st in ex.stage_stats())


@pytest.mark.slow
def test_stage_actors_of_one_stage_refuse_virtual_stages(p2p, tiny):
    ex, n = p2p
    with pytest.raises(ScheduleError, match="each stage actor hosts 1; create the executor with virtual=2"):
        ex.run(build_schedule("interleaved", n, n, virtual=2), iter(microbatches(tiny[1], 1, 32, n)))


def test_transports_that_host_one_stage_per_actor_refuse_virtual_stages(ray_session, tiny):
    with pytest.raises(ConfigError, match="pipeline.transport=object_store runs one stage per stage actor; use "
                                          "pipeline.transport=p2p"):
        RayExecutor(make_stages(tiny[0], "interleaved", 4), "interleaved", transport="object_store", virtual=2)
