"""A torch.profiler run as a short markdown section: where a piece of work's time goes on a GPU.

Reported: the wall time (the profiled one, and the same work timed without the profiler where the
caller has it: the profiler's cost per launch lengthens the first), how long the GPU's kernels
were busy inside it (their summed durations; one stream, so no overlap to subtract) and the share
of the wall time that is, the number of kernel launches (copies and fills counted apart), then the
operators by GPU time and by host time. A GPU busy for a small share of the wall time waits on the
host: fewer launches (fusion, CUDA graphs) pay there, faster kernels do not. On a CPU only the host
table is made.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile


def profiler(device: torch.device) -> profile:
    """torch.profiler over the host's operators, and the GPU's kernels where `device` is one."""
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))


def gpu_work(prof: Any) -> tuple[list[Any], list[Any]]:
    """(kernels, copies and fills) among a profile's GPU events; user annotations (`record_function`
    spans that torch.optim and others mirror on the GPU's timeline) are neither."""
    events = [e for e in prof.events()
              if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    moves = [e for e in events if e.name.startswith(("Memcpy", "Memset"))]
    return [e for e in events if not e.name.startswith(("Memcpy", "Memset"))], moves


def summary(prof: Any, wall_s: float, title: str, per: int = 1, unit: str = "step", plain_s: float | None = None,
            rows: int = 25) -> str:
    """Markdown for a finished `torch.profiler.profile` over `wall_s` seconds of `per` units of work
    (`plain_s`: the same work without the profiler)."""
    kernels, moves = gpu_work(prof)
    busy_ms = sum(e.device_time for e in kernels + moves) / 1e3
    wall_ms = 1e3 * wall_s
    line = f"- wall {wall_ms / per:.2f} ms a {unit} profiled"
    if plain_s is not None:
        line += f", {1e3 * plain_s / per:.2f} without the profiler"
    if kernels:
        line += (f"; GPU busy {busy_ms / per:.2f} ms a {unit} ({100 * busy_ms / wall_ms:.0f}% of the profiled wall "
                 f"time); {len(kernels) / per:.0f} kernel launches and {len(moves) / per:.0f} copies or fills a {unit}")
    else:
        line += " (no GPU kernels seen)"
    table = prof.key_averages().table
    out = [f"## {title}", "", line, ""]
    if kernels:
        out += ["By GPU time (self):", "", "```",
                table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60), "```", ""]
    out += ["By host time (self):", "", "```",
            table(sort_by="self_cpu_time_total", row_limit=rows if not kernels else 15, max_name_column_width=60),
            "```", ""]
    return "\n".join(out)
