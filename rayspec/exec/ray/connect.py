"""Start Ray or join a cluster, as ``ray.address`` says, and never wait without bound for a head that is gone.

[Note: Ray address] ``ray.init()`` with no address joins the head that the last ``ray start`` on this machine
recorded in ``<RAY_TMPDIR, else TMPDIR, else /tmp>/ray/ray_current_cluster``, and that file outlives a head
killed without ``ray stop``. Ray 2.60 then retries the dead GCS: ``RAY_NUM_REDIS_GET_RETRIES`` (20) attempts,
or ``RAY_gcs_server_port_wait_time_s`` attempts where that is set (read at each connection), each a
``GcsClient`` connection that waits up to ``RAY_py_gcs_connect_timeout_s`` (30 s; read by Ray's C++ config
when it loads, so not changeable in a running process) in C++ code, where Python's signal handlers (the
SIGTERM handler ``ray.init`` installs) do not run: about ten minutes, deaf to SIGTERM for 30 s at a time.

So rayspec resolves the address itself:

- ``null`` (or ``local``): a fresh local Ray (``ray.init(address="local")``), which ignores the recorded
  head, unless ``RAY_ADDRESS`` is set (a ``ray job submit`` job gets it): then it joins that cluster;
- ``auto``: ``RAY_ADDRESS``, else the recorded head, else whatever Ray's own ``auto`` finds running here;
- ``HOST:PORT`` or ``ray://HOST:PORT``: that head.

Before joining it waits at most ``ray.connect_timeout_s`` for the head's port to accept a TCP connection (a
killed head refuses at once; Python code, so SIGTERM ends it), then lets ``ray.init`` try about once per
31 s of what is left of that time (``RAY_gcs_server_port_wait_time_s``, set for the call). A head whose
port accepts but whose GCS never answers can still hold ``ray.init`` for 30 s per attempt.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import time
from pathlib import Path

import ray

from rayspec.config import RayConfig
from rayspec.errors import ConfigError

__all__ = ["ensure_ray", "resolve_address", "recorded_address_file", "wait_for_head"]

log = logging.getLogger(__name__)

_ATTEMPT_S = 31.0
"""What one of ``ray.init``'s attempts to reach a GCS can take (``RAY_py_gcs_connect_timeout_s`` + 1 s)."""


def ensure_ray(options: RayConfig) -> None:
    """Start or join Ray as ``options`` say, unless Ray runs in this process already; log which in one line.

    Raises:
        ConfigError: the head at the address does not answer within ``ray.connect_timeout_s`` (the message names
            the address, where it came from, and the fixes), or ``ray.num_cpus`` is set for a cluster to join.
    """
    if ray.is_initialized():
        return
    address, source = resolve_address(options.address)
    if address is None:
        ray.init(address="local", num_cpus=options.num_cpus, include_dashboard=False,
                 log_to_driver=options.log_to_driver)
        cpus = ray.cluster_resources().get("CPU", 0)
        log.info("Ray: started a local instance with %g CPUs (%s)", cpus, source)
        return
    if options.num_cpus is not None:
        raise ConfigError(
            f"ray.num_cpus={options.num_cpus} applies only when rayspec starts Ray itself, but it joins the cluster "
            f"at {address} ({source}); remove ray.num_cpus (the cluster's nodes set their CPUs)"
        )
    deadline = time.monotonic() + options.connect_timeout_s
    if address != "auto":
        wait_for_head(address, source, options.connect_timeout_s)
    attempts = max(1, math.ceil((deadline - time.monotonic()) / _ATTEMPT_S))
    before = os.environ.get("RAY_gcs_server_port_wait_time_s")
    os.environ["RAY_gcs_server_port_wait_time_s"] = str(attempts)  # ray.init's attempts (Ray 2.60, node.py)
    try:
        ray.init(address=address, log_to_driver=options.log_to_driver)
    except ConnectionError as err:
        raise ConfigError(f"could not join the Ray cluster at ray.address={options.address} ({source}): {err}; "
                          f"{_FIXES}") from err
    finally:
        if before is None:
            os.environ.pop("RAY_gcs_server_port_wait_time_s", None)
        else:
            os.environ["RAY_gcs_server_port_wait_time_s"] = before
    log.info("Ray: joined the cluster at %s (%s)", address, source)


_FIXES = ("start its head (`ray start --head`), give the address of a live head (ray.address=HOST:PORT), "
          "or use ray.address=null for a local Ray of this run's own")


def resolve_address(address: str | None) -> tuple[str | None, str]:
    """The address to join (None: start a local Ray) and where it came from, for ``ray.address`` ([Note: Ray address])."""
    env = os.environ.get("RAY_ADDRESS") or None
    if address in (None, "local"):
        if address is None and env:
            return env, "RAY_ADDRESS is set: a Ray job joins its cluster"
        why = "ray.address=local" if address == "local" else "ray.address=null and RAY_ADDRESS is not set"
        return None, why
    if address == "auto":
        if env:
            return env, "ray.address=auto, from RAY_ADDRESS"
        path = recorded_address_file()
        recorded = _read(path)
        if recorded:
            return recorded, f"ray.address=auto: the head that `ray start` recorded in {path}"
        return "auto", "ray.address=auto: no head recorded, so any Ray running on this machine"
    return address, f"ray.address={address}"


def recorded_address_file() -> Path:
    """Where ``ray start`` records its head on this machine, as Ray 2.60 looks for it."""
    if os.environ.get("RAY_TMPDIR"):
        base = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and os.environ.get("TMPDIR"):
        base = os.environ["TMPDIR"]
    else:
        base = "/tmp"
    return Path(base) / "ray" / "ray_current_cluster"


def wait_for_head(address: str, source: str, timeout_s: float) -> None:
    """Return once ``address``'s port accepts a TCP connection; ``ConfigError`` after ``timeout_s``."""
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))):
                return
        except OSError as err:
            if time.monotonic() + 0.5 >= deadline:
                raise ConfigError(
                    f"no Ray head answers at {address} ({source}) within {timeout_s:g} s: {err}; "
                    f"{_FIXES} (ray.connect_timeout_s waits longer for a head that is starting)"
                ) from err
        time.sleep(0.5)


def _host_port(address: str) -> tuple[str, int]:
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"ray.address={address} is not HOST:PORT (or ray://HOST:PORT, auto, or null)")
    return host.strip("[]"), int(port)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
