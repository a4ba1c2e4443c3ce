"""Machine facts the benchmarks print beside their figures (read without importing torch, except
`cpu_report`'s matmul rate)."""
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


def cpu_report() -> str:
    """The CPU's model, its bf16 flags and its fp32 / bf16 matmul rate right now (1024 x 1024, the
    best of 3, at torch's thread count: the load shows in it), and the load average."""
    import time

    import torch

    flags = cpu_flags()
    have = [f for f in ("avx512_bf16", "amx_bf16", "avx512f") if f in flags]
    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        n = 1024
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        rates.append(f"{str(dtype).replace('torch.', '')} {2 * n ** 3 / best / 1e9:.0f} GFLOP/s")
    try:
        load = open("/proc/loadavg").read().split()[0]
    except OSError:
        load = "?"
    model = cpuinfo("model name").get("model name", "unknown CPU")
    return (f"cpu: {model}; bf16 flags {', '.join(have) or 'none (bf16 is emulated)'}; matmul {'; '.join(rates)} "
            f"({torch.get_num_threads()} threads); load average {load}")
