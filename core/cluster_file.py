"""A cluster's TOML file (``partita calibrate -o local.toml`` writes one; ``--cluster FILE.toml``
reads it): the keys in human units (GB, GB/s, us, ms, TFLOP/s), each with the ``ClusterSpec`` field
it fills and its scale, in one table the reader and the writer share."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from partita.core.errors import ClusterError
from partita.core.files import read_user_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GB = 1e9
TFLOPS = 1e12
# the collective kinds the cost model prices (passes/cost_model.py) and a cluster file may give call costs for
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
MAX_CLUSTER_FILE_BYTES = 1 << 20  # a cluster file is a few lines of TOML
CLUSTER_HINT = "fix the cluster file (`partita calibrate -o local.toml` writes a valid one) or use a preset"


def finite_number(v: Any, *, low: float, low_open: bool = False) -> bool:
    """``v`` is a finite real number (not a bool) above ``low`` (or at it, unless ``low_open``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return v > low if low_open else v >= low


_TOML_KEYS = {
    "name": ("name", str, 1),
    "nodes": ("nodes", int, 1),
    "gpus_per_node": ("gpus_per_node", int, 1),
    "device": ("device", str, 1),
    "device_name": ("device_name", str, 1),
    "memory_gb": ("memory_bytes", float, GB),
    "efficiency": ("efficiency", float, 1),
    "hbm_gb_per_s": ("hbm_bandwidth", float, GB),
    "intra_node_gb_per_s": ("intra_node_bandwidth", float, GB),
    "inter_node_gb_per_s": ("inter_node_bandwidth", float, GB),
    "intra_node_latency_us": ("intra_node_latency", float, 1e-6),
    "inter_node_latency_us": ("inter_node_latency", float, 1e-6),
    "nvlink": ("nvlink", bool, 1),
    "memory_reserve": ("memory_reserve", float, 1),
    "step_overhead_ms": ("step_overhead_s", float, 1e-3),
    "roofline": ("roofline", bool, 1),
    "source": ("source", str, 1),
    "attention_efficiency": ("attention_efficiency", float, 1),
    "memory_efficiency": ("memory_efficiency", float, 1),
    "kernel_us": ("kernel_s", float, 1e-6),
    "launch_us": ("launch_s", float, 1e-6),
    "alloc_granularity": ("alloc_granularity", int, 1),
    "fragmentation": ("fragmentation", float, 1),
    "host_gb_per_s": ("host_bandwidth", float, GB),
    "host_memory_gb_per_s": ("host_memory_bandwidth", float, GB),
}
_TOML_TABLES = ("tflops", "call_latency_us", "sources")
_REQUIRED_TOML = ("nodes", "gpus_per_node", "device", "memory_gb", "intra_node_gb_per_s", "inter_node_gb_per_s")


def cluster_toml(spec: Mapping[str, Any]) -> str:
    """A cluster (``ClusterSpec.to_dict``) as its TOML file: every key of the table, then its rates,
    call costs and sources."""
    lines = [f"# partita cluster file{(': ' + spec['source']) if spec['source'] else ''}"]
    for key, (name, typ, scale) in _TOML_KEYS.items():
        v = spec[name]
        if typ is str:
            lines.append(f"{key} = {json.dumps(v)}")
        elif typ is bool:
            lines.append(f"{key} = {'true' if v else 'false'}")
        elif typ is int:
            lines.append(f"{key} = {v}")
        else:
            lines.append(f"{key} = {v / scale:.6g}")
    lines += ["", "[tflops]"] + [f"{k} = {v / TFLOPS:.6g}" for k, v in spec["flops"].items()]
    if spec["call_latency"]:
        lines += ["", "[call_latency_us]"] + [f"{k} = {v * 1e6:.6g}" for k, v in spec["call_latency"].items()]
    if spec["sources"]:
        lines += ["", "[sources]"] + [f"{k} = {json.dumps(v)}" for k, v in spec["sources"].items()]
    return "\n".join(lines) + "\n"


def toml_values(path: Path) -> dict[str, Any]:
    """A cluster's ``ClusterSpec`` keywords from its TOML file in human units; every value checked for
    its type here and for its range by ``ClusterSpec``: a mistake is one ``ClusterError`` naming the key."""
    def bad(what: str) -> ClusterError:
        return ClusterError(f"cluster file {path}: {what}", hint=CLUSTER_HINT)

    text = read_user_text(path, what="cluster file", limit=MAX_CLUSTER_FILE_BYTES, error=ClusterError,
                          hint="pass the path of a .toml cluster file, or a preset name")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"cluster file {path} is not valid TOML: {e}", hint=CLUSTER_HINT) from e
    unknown = set(raw) - set(_TOML_KEYS) - set(_TOML_TABLES)
    if unknown:
        raise ClusterError(f"cluster file {path}: unknown key(s) {', '.join(sorted(unknown))}",
                           hint=f"the keys are {', '.join(_TOML_KEYS)}, [tflops], [call_latency_us] and [sources]")
    kw: dict[str, Any] = dict(
        name=path.stem, device_name="GPU", efficiency=1.0, hbm_bandwidth=2e12,
        intra_node_latency=5e-6, inter_node_latency=10e-6, nvlink=False, source=str(path),
    )
    for key, value in raw.items():
        if key in _TOML_TABLES:
            continue
        field_name, typ, scale = _TOML_KEYS[key]
        if typ is str and not isinstance(value, str):
            raise bad(f"{key} = {value!r} must be text")
        if typ is bool and not isinstance(value, bool):
            raise bad(f"{key} = {value!r} must be true or false")
        if typ in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(f"{key} = {value!r} must be a number")
            if not math.isfinite(value):
                raise bad(f"{key} = {value!r} must be a finite number")
            if typ is int and not isinstance(value, int):
                raise bad(f"{key} = {value!r} must be an integer")
        kw[field_name] = value * scale if typ is float else value
    missing = [k for k in _REQUIRED_TOML if k not in raw]
    if missing:  # after the types: a key of the wrong type is named first
        raise ClusterError(f"cluster file {path} lacks {', '.join(missing)}", hint=CLUSTER_HINT)
    kw["memory_bytes"] = int(kw["memory_bytes"])
    tflops = raw.get("tflops")
    if not isinstance(tflops, dict) or not tflops:
        raise bad("needs a [tflops] table, e.g. fp32 = 19.5, bf16 = 312")
    for k, v in tflops.items():
        if not finite_number(v, low=0, low_open=True):
            raise bad(f"[tflops] {k} = {v!r} must be a positive finite number")
    kw["flops"] = {k: float(v) * TFLOPS for k, v in tflops.items()}
    calls = raw.get("call_latency_us", {})
    if not isinstance(calls, dict) or any(k not in COLLECTIVES or not finite_number(v, low=0)
                                          for k, v in calls.items()):
        raise bad(f"[call_latency_us] takes microseconds >= 0 per collective kind ({', '.join(COLLECTIVES)}), "
                  f"got {calls!r}")
    kw["call_latency"] = {k: float(v) * 1e-6 for k, v in calls.items()}
    sources = raw.get("sources", {})
    if not isinstance(sources, dict) or any(not isinstance(v, str) for v in sources.values()):
        raise bad(f"[sources] takes text per figure, got {sources!r}")
    kw["sources"] = dict(sources)
    return kw
