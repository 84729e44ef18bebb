"""How much memory a process can still allocate before it allocates (the engines compare
their estimate with it: on Linux an allocation past it is not refused, the OOM killer ends
the process later, SIGKILL: no message, no file).

    available_memory(device) -> int | None
        on a CPU the smaller of /proc/meminfo's MemAvailable and the room under this
        process's cgroup limits (cgroup_room: v1 and v2, the whole hierarchy, inactive file
        cache not counted as used); on CUDA torch.cuda.mem_get_info's free bytes plus the
        caching allocator's unused blocks; None where unknown
"""
from __future__ import annotations

from pathlib import Path

import torch


MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
NO_LIMIT = 1 << 60  # a cgroup v1 limit this large means none (v1 writes 2^63 - 4096; v2 writes "max")


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes that can still be allocated on `device` (module docstring), or None."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) + max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    known = [b for b in (meminfo_available(), cgroup_room()) if b is not None]
    return min(known) if known else None


def meminfo_available(path: str = MEMINFO) -> int | None:
    """/proc/meminfo's MemAvailable in bytes (free memory plus what the kernel can reclaim)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_room(root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> int | None:
    """Bytes left under this process's cgroup memory limits: the least of limit - usage over its
    cgroup and the ones above it (a parent's limit binds too), usage less the inactive file
    cache the kernel reclaims first (memory.stat). cgroup v2: memory.max ("max": none) and
    memory.current; v1: memory.limit_in_bytes (>= 2^60: none) and memory.usage_in_bytes. None
    where no limit is set or readable."""
    try:
        with open(self_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    places = []  # (the controller's mount, this process's cgroup under it, limit file, usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            places.append((Path(root), parts[2], "memory.max", "memory.current"))
        elif "memory" in parts[1].split(","):
            places.append((Path(root) / "memory", parts[2], "memory.limit_in_bytes", "memory.usage_in_bytes"))
    if not places:  # no /proc/self/cgroup: the mount's own files (a container's cgroup namespace)
        places = [(Path(root), "/", "memory.max", "memory.current"),
                  (Path(root) / "memory", "/", "memory.limit_in_bytes", "memory.usage_in_bytes")]
    rooms = []
    for mount, path, limit_name, usage_name in places:
        folder = mount / path.strip("/")
        while True:
            room = _room(folder, limit_name, usage_name)
            if room is not None:
                rooms.append(room)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return max(0, min(rooms)) if rooms else None


def _room(folder: Path, limit_name: str, usage_name: str) -> int | None:
    """limit - (usage - inactive file cache) of one cgroup folder; None without a limit."""
    try:
        limit_text = (folder / limit_name).read_text().strip()
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        usage = int((folder / usage_name).read_text().strip())
    except (OSError, ValueError):
        return None
    stat = {}
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            stat[key] = value
        inactive = int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        inactive = 0
    return int(limit_text) - max(0, usage - inactive)
