"""Several nodes, simulated on this host with real launches: two ``torchrun`` "nodes" of one process each train ZeRO-2,
are killed with SIGKILL and resume exactly; a master port already taken, or a peer that never comes, fails fast with
one line (``vlm/training/distributed.py``) instead of hanging."""

import socket
import subprocess
import time

import pytest
from train_kit import ROOT, env, kill_node, node_log, start_nodes, step_records, train_cmd, wait_nodes

from vlm.training.distributed import DistributedError, check_master_port, free_port


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_master_port_check_on_this_host_only(monkeypatch):
    """The check (in process, no launch): a listened-on port fails on rank 0 only; a port whose last connection is in
    TIME_WAIT passes (a resume right after a run); so does a port on another host, or one a torchrun agent holds."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store (TCPStore) sets it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        with pytest.raises(DistributedError, match=r"already in use on this host .* --master_port \d+$"):
            check_master_port()
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        check_master_port()
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
        monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: never this host
        check_master_port()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("RANK", "1")
        check_master_port()
        monkeypatch.setenv("RANK", "0")
        client = socket.create_connection(("127.0.0.1", busy.getsockname()[1]))
        server, _ = busy.accept()
    server.close()  # the accepting side closes first: its end of the connection stays in TIME_WAIT
    client.close()
    time.sleep(0.2)
    check_master_port()
    monkeypatch.setenv("MASTER_PORT", "29500x")
    with pytest.raises(DistributedError, match="not a TCP port"):
        check_master_port()


def test_master_port_in_use_fails_fast_with_one_line(shards, tmp_path):
    """Another process listens on the port given to the ``deepspeed`` launcher: rank 0 stops before the process
    group exists, with one line naming ``--master_port`` and a free port; the launcher then ends the other rank."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = train_cmd(tmp_path / "run", shards, launcher="deepspeed", zero=2, max_steps=2, export="false")
        cmd[cmd.index("--master_port") + 1] = str(port)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=150)  # not a hang
    assert proc.returncode != 0
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"master port {port} is already in use" in errors[0] and "--master_port " in errors[0]


def test_peer_that_never_comes_fails_within_the_rendezvous_timeout(shards, tmp_path):
    """Rank 0 of two, launched alone (as if the other node were never started): the bounded rendezvous
    (``VLM_RENDEZVOUS_TIMEOUT_S``) ends it with one line instead of a 30-minute hang."""
    e = dict(env(free_port()), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    e["VLM_RENDEZVOUS_TIMEOUT_S"] = "3"
    cmd = train_cmd(tmp_path / "run", shards, zero=2, max_steps=2, export="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 0 of 2 could not join the process group" in errors[0] and "within 3 s" in errors[0]


def _two_ports() -> tuple[int, int]:
    first = free_port()
    second = free_port()
    while second == first:
        second = free_port()
    return first, second


def test_two_nodes_kill_9_then_resume_auto_gives_identical_losses(shards, tmp_path):
    """Two ``torchrun --nnodes 2 --nproc_per_node 1 --node_rank {0,1}`` launches sharing one run folder (as on a
    shared filesystem), ZeRO-2: both nodes are killed with SIGKILL after step 3 was logged, both resume with
    ``--resume auto``, and the losses are those of an uninterrupted two-node run (started alongside, to save time),
    each step logged once."""
    args = dict(zero=2, max_steps=6, save_every=2, export="false")
    reference, run = tmp_path / "reference", tmp_path / "killed"
    ref_port, port = _two_ports()
    ref_nodes = start_nodes(reference, shards, ref_port, **args)
    nodes = start_nodes(run, shards, port, **args)
    metrics, deadline = run / "metrics.jsonl", time.time() + 180
    while time.time() < deadline and all(n.poll() is None for n in nodes):
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    assert all(n.poll() is None for n in nodes), "a node ended before it could be killed"
    for node in nodes:
        kill_node(node)
    assert len(step_records(run)) < 6
    wait_nodes(ref_nodes, reference)
    wait_nodes(start_nodes(run, shards, free_port(), resume="auto", **args), run)
    assert "resumed from" in node_log(run, 0).read_text()
    got, want = step_records(run), step_records(reference)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert [got[s]["loss"] for s in sorted(got)] == [want[s]["loss"] for s in sorted(want)]
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000006").glob("rank_state_*")) == [
        "rank_state_00000.json",
        "rank_state_00001.json",
    ]
