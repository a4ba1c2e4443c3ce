"""Machine facts the benchmarks print beside their figures (read without importing torch)."""
from __future__ import annotations


def cpuinfo(*keys: str) -> dict[str, str]:
    """The values of the first /proc/cpuinfo lines named `keys` ("flags", "model name"), read once;
    a key not found (or no /proc/cpuinfo) is left out."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys and key.strip() not in out:
                    out[key.strip()] = value.strip()
                if len(out) == len(keys):
                    break
    except OSError:
        pass
    return out


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line; empty where there is none)."""
    return set(cpuinfo("flags").get("flags", "").split())
