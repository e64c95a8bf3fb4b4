"""The transport a run gets for each placement, checked without a GPU: what the cluster reports is injected, and
so is what a stage actor's process has (CUDA, torch's NCCL, cupy)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rayspec.config import ConfigError
from rayspec.config.sections import PipelineConfig
from rayspec.core import device
from rayspec.core.transports import TRANSPORTS, nccl_kind, resolve_transport

# gpus per stage -> what auto picks, and which NCCL it then needs in the stage actors
AUTO = {0.0: ("p2p", None), 0.25: ("p2p", None), 0.5: ("p2p", None), 1.0: ("p2p_nccl", "torch"),
        2.0: ("p2p_nccl", "torch")}


@pytest.mark.parametrize("gpus", sorted(AUTO))
def test_auto_picks_a_path_that_works_for_the_placement(gpus):
    name = resolve_transport("auto", gpus)
    assert (name, nccl_kind(name, gpus)) == AUTO[gpus]


@pytest.mark.parametrize("gpus", [0.25, 0.5])
@pytest.mark.parametrize("name", ["nccl", "p2p_nccl"])
def test_nccl_is_refused_up_front_where_stages_share_a_gpu(name, gpus):
    with pytest.raises(ConfigError) as info:
        resolve_transport(name, gpus)
    message = str(info.value)
    assert f"pipeline.transport={name} with pipeline.gpus_per_stage={gpus:g}" in message
    assert "two NCCL ranks on one device" in message
    assert "pipeline.transport=auto (p2p, through host memory) or one of p2p, object_store, compiled" in message
    assert "pipeline.gpus_per_stage=1" in message


def test_every_transport_and_placement_is_decided():
    """Each transport either resolves or is refused with the transports that fit, for each placement."""
    for name in TRANSPORTS:
        for gpus in (0.0, 0.25, 1.0):
            try:
                got = resolve_transport(name, gpus)
            except ConfigError as err:
                assert "use pipeline.transport=auto" in str(err)
            else:
                assert got == name or name == "auto"
    assert nccl_kind("nccl", 1.0) == nccl_kind("compiled", 1.0) == "ray"  # Ray's NCCL: cupy in the stage actors
    assert nccl_kind("compiled", 0.5) is None and nccl_kind("object_store", 1.0) is None
    with pytest.raises(ConfigError, match="moves CPU tensors only; use pipeline.transport=auto \\(p2p_nccl\\)"):
        resolve_transport("gloo", 1.0)
    with pytest.raises(ConfigError, match="moves GPU tensors and the stages have none"):
        resolve_transport("p2p_nccl", 0.0)


def test_a_cpu_only_head_accepts_a_gpu_transport_and_the_cluster_decides(monkeypatch):
    """The driver of ``ray job submit`` may run on a head without CUDA: the config does not ask it; the stage
    resources the cluster reports (injected here) decide, before any actor starts."""
    import ray

    from rayspec.exec.ray.cluster import stage_resources

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this process: no CUDA
    for name in ("nccl", "p2p_nccl", "auto"):
        PipelineConfig(transport=name, stages=2).check()  # gpus_per_stage null: not refused here
    with pytest.raises(ConfigError, match="the stages have none"):
        PipelineConfig(transport="nccl", stages=2, gpus_per_stage=0).check()
    with pytest.raises(ConfigError, match="two NCCL ranks on one device"):
        PipelineConfig(transport="nccl", stages=4, gpus_per_stage=0.25).check()
    placements = {  # what the cluster reports -> GPUs per stage, what auto resolves to
        (("CPU", 16.0), ("GPU", 4.0)): (1.0, "p2p_nccl"),
        (("CPU", 16.0), ("GPU", 2.0)): (1.0, "p2p_nccl"),
        (("CPU", 16.0),): (0.0, "p2p"),
    }
    for reported, (gpus, auto) in placements.items():
        monkeypatch.setattr(ray, "cluster_resources", lambda reported=reported: dict(reported))
        cpus, got = stage_resources(None, None, 2)
        assert (got, resolve_transport("auto", got)) == (gpus, auto)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    cpus, got = stage_resources(None, 0.25, 4)  # one GPU, four stages: set explicitly
    assert resolve_transport("auto", got) == "p2p"
    with pytest.raises(ConfigError, match="4 stages need one GPU each but the Ray cluster has 1"):
        stage_resources(None, None, 4)


def test_the_nccl_check_names_what_is_missing_and_the_extra(monkeypatch):
    assert device.nccl_problem(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "torch sees no GPU there" in device.nccl_problem("torch", "p2p_nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert "this torch build lacks" in device.nccl_problem("torch", "p2p_nccl")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert device.nccl_problem("torch", "p2p_nccl") is None  # torch's own NCCL: no cupy needed
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed: importing it raises ImportError
    problem = device.nccl_problem("ray", "nccl")
    assert problem.startswith("pipeline.transport=nccl uses Ray's NCCL, which needs cupy")
    assert "pip install 'rayspec[gpu]'" in problem and "cupy-cuda13x" in problem and "cupy-cuda12x" in problem
    broken = types.ModuleType("cupy.cuda.nccl")

    def no_library():
        raise RuntimeError("libnccl.so.2: cannot open shared object file")

    broken.get_version = no_library  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupy.cuda", types.ModuleType("cupy.cuda"))
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", broken)
    assert "cupy cannot load NCCL (RuntimeError: libnccl.so.2" in device.nccl_problem("ray", "compiled")
    broken.get_version = lambda: 22807  # type: ignore[attr-defined]
    assert device.nccl_problem("ray", "nccl") is None


def test_deterministic_settings_are_set_and_undone():
    before = device.deterministic(True)
    try:
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        device.restore(before)
    assert torch.backends.cudnn.allow_tf32 == before["cudnn_tf32"]


def test_a_transport_start_refuses_actors_without_the_nccl_it_needs(monkeypatch):
    """``Transport.start`` asks every stage actor; the first problem is a ConfigError naming the stage."""
    from rayspec.exec.ray.object_store import ObjectStoreTransport

    class Remote:
        def __init__(self, answer):
            self.answer = answer

        def remote(self, kind, name):
            return (kind, name, self.answer)

    class Actor:
        def __init__(self, answer):
            self.nccl_problem = Remote(answer)

    import ray

    link = ObjectStoreTransport("nccl")
    assert link.nccl == "ray" and link.replaces == "none"
    monkeypatch.setattr(ray, "get", lambda refs: [r[2] for r in refs])
    with pytest.raises(ConfigError, match="stage 1: cupy is missing"):
        link.start([Actor(None), Actor("cupy is missing")])


def test_every_transport_is_built_by_the_implementation_its_line_names():
    """A registry line owns its factory ([Note: transports as plug-ins]): each resolved name builds a transport of
    that name, with the NCCL the line says it uses on a GPU per stage; ``auto`` stands for another and builds none."""
    from rayspec.exec.ray.transport import Transport, TransportOptions, make_transport

    for name, spec in TRANSPORTS.items():
        if spec.factory is None:
            with pytest.raises(ValueError, match="resolve it first"):
                make_transport(name)
            continue
        gpus = 0.0 if spec.cpu else 1.0
        link = make_transport(name, TransportOptions(chunk=3, max_in_flight=5, gpus_per_stage=gpus))
        assert isinstance(link, Transport) and link.name == name
        assert link.nccl == nccl_kind(name, gpus)
    assert make_transport("p2p", TransportOptions(chunk=3)).chunk == 3
    assert make_transport("gloo", TransportOptions(max_in_flight=5)).max_in_flight == 5


def test_global_clipping_is_asked_of_the_transport():
    """The executor tells the transport whether updates wait for every stage's norm; one that cannot gather them
    refuses with the fix, and turning clipping off again is always accepted."""
    from rayspec.exec.ray.transport import make_transport

    link = make_transport("object_store")
    link.clip_globally(True, "gpipe")
    assert link.global_norm
    compiled = make_transport("compiled")
    with pytest.raises(ConfigError, match="pipeline.transport=compiled cannot gather"):
        compiled.clip_globally(True, "gpipe")
    compiled.clip_globally(False, "gpipe")
    assert not compiled.global_norm
