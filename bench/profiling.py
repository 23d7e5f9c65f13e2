"""A torch.profiler run as a short markdown section: where a piece of work's time goes on a GPU.

Reported: the wall time, how long the GPU's kernels were busy inside it (their summed durations;
one stream, so no overlap to subtract) and what share of the wall time that is, the number of
kernel launches, then the operators by GPU time and by host time. A GPU that is busy for a small
share of the wall time waits on the host: fewer launches (fusion, CUDA graphs) pay there, faster
kernels do not. On a CPU only the host table is made.
"""

from __future__ import annotations

from typing import Any

from torch.profiler import DeviceType


def summary(prof: Any, wall_s: float, title: str, per: int = 1, unit: str = "step", rows: int = 25) -> str:
    """Markdown for a finished `torch.profiler.profile` over `wall_s` seconds of `per` units of work."""
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3
    wall_ms = 1e3 * wall_s
    line = f"- wall {wall_ms / per:.1f} ms a {unit}"
    if kernels:
        line += (f"; GPU kernels busy {busy_ms / per:.1f} ms a {unit} ({100 * busy_ms / wall_ms:.0f}% of the wall "
                 f"time); {len(kernels) / per:.0f} kernel launches a {unit}")
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
