"""Launching a 2-process torch.distributed test (torchrun, gloo on CPU) so that a failure can be
diagnosed from the test report alone: every rank's whole stdout and stderr, not a tail."""
import re
import signal
import subprocess
import sys
from pathlib import Path

# torchrun's copy of a worker line ("[rank1]:...", see run_two_ranks): the rank files hold them whole.
_TEED_LINE = re.compile(r"^\[rank\d+\]:")


def run_two_ranks(args: list[str], logs: Path, *, env: dict[str, str], timeout_s: float = 300,
                  nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=NPROC ARGS` (2 processes unless `nproc` says otherwise). Each rank's stdout and stderr are written
    whole to files under `logs` (what C++ prints at a crash included: the redirect is of the
    process's file descriptors) and also copied, line by line with a ``[rankN]:`` prefix, to
    torchrun's own stderr (what a user sees). Past `timeout_s` torchrun gets SIGTERM, which stops
    its workers (each runs in its own session, out of reach of a kill of torchrun's group), and the
    test fails with every rank's output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--log-dir", str(logs), "--redirects", "3", "--tee", "3", *args]
    env = {**env, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        raise AssertionError(f"torchrun did not finish within {timeout_s:.0f} s\n{rank_report(done, logs)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def rank_report(proc: subprocess.CompletedProcess, logs: Path) -> str:
    """Everything a `run_two_ranks` run printed, whole: torchrun's exit status and its own lines
    (its summary names each failed rank's exit code or signal), then each rank's stderr and stdout."""
    agent = [line for line in (proc.stderr or "").splitlines() if not _TEED_LINE.match(line)]
    parts = [f"torchrun exit status {proc.returncode}; rank logs under {logs}",
             "----- torchrun stderr (worker lines left out: see the rank files) -----", *agent]
    # torchrun's layout: LOGS/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log
    for path in sorted(logs.glob("*/attempt_*/*/std*.log"), key=lambda p: (p.parent.parent.name, int(p.parent.name), p.name)):
        text = path.read_text(errors="replace")
        if text.strip():
            parts += [f"----- rank {path.parent.name} {path.stem} ({path.parent.parent.name}, whole) -----", text.rstrip()]
    return "\n".join(parts)


def run_two_nodes(args: list[str], logs: Path, *, env: dict[str, str], timeout_s: float = 300) -> str:
    """Two torchrun "nodes" on this machine (`--nnodes 2 --node_rank 0|1`, one process each,
    static rendezvous on 127.0.0.1), as a user launches one job over two machines. Returns node
    0's stdout; a node that fails or outlives `timeout_s` fails the test with both nodes' reports."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**env, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
               "--master_addr=127.0.0.1", f"--master_port={port}", "--log-dir", str(logs / f"node{node}"),
               "--redirects", "3", "--tee", "3", *args]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)))
    done = []
    for cmd, proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    if any(d.returncode != 0 for d in done):
        raise AssertionError("\n".join(f"===== node {i} =====\n{rank_report(d, logs / f'node{i}')}"
                                       for i, d in enumerate(done)))
    return done[0].stdout
