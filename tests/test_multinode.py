"""Several nodes: two torchrun agents on this machine act as two nodes; the checkpoint-folder check.

The end-to-end test starts two agents the way two nodes are started (`torchrun --nnodes 2
--nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT`), 4 GRPO ranks with hybrid
sharding (actor fsdp_size=2: each node's 2 ranks shard the model, the 2 nodes replicate it). A
user reward function written by the test scores the response's digits (so advantages, losses and
gradients are not zero) and, once the step-2 checkpoint is sealed, parks the ranks of the second
node in scoring and names one of its processes; the test then SIGKILLs every process of that node.
Checked:
- an uninterrupted run trains steps 1-4;
- after the kill, the surviving node exits non-zero within a bound, naming the failure;
- both nodes relaunched with the same command resume from checkpoint 2 and train steps 3-4, and
  every metric of every step but the timings equals the uninterrupted run's (bit for bit).

The unit test runs the start-up check on 2 gloo ranks: a folder of its own per rank (the node-local
disks of two nodes) is refused on both ranks, naming trainer.default_local_dir; one shared folder
passes, and the probe leaves the folder (an earlier checkpoint in it) exactly as it was.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import pytest

from tests.dist_utils import free_port, run_distributed
from tests.test_e2e_train import ENV, ROOT
from tinyzero.trainer.loggers import read_metrics

STEPS, SAVE_FREQ, COLLECTIVE_TIMEOUT_S = 4, 2, 60
# The surviving node must be gone within this long after the kill (its ranks fail on the broken
# connection at once, or at the latest after reliability.collective_timeout_s).
EXIT_BOUND_S = COLLECTIVE_TIMEOUT_S + 30
RUN_TIMEOUT_S = 300

REWARD = '''
"""Test reward: a digit count (never all equal, so GRPO advantages are not zero); a node parks once checkpoint 2 exists."""
import os
import time


def score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ.get("FAULT_READY") and os.environ.get("GROUP_RANK") == "1" \\
            and os.path.exists(os.environ["FAULT_AFTER"]):
        with open(os.environ["FAULT_READY"] + ".tmp-" + str(os.getpid()), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.environ["FAULT_READY"] + ".tmp-" + str(os.getpid()), os.environ["FAULT_READY"])
        time.sleep(3600)  # the test kills this node
    return sum(c.isdigit() for c in solution_str) / 4.0
'''


# ---------------------------------------------------------------------------------------- unit test
def _probe(cases: list[list[str]]) -> list[str | None]:
    """Run the check once per case (case[rank]: this rank's folder); the error message of each, or None."""
    from tinyzero.config import ConfigError
    from tinyzero.distributed import get_rank, init_distributed
    from tinyzero.trainer.storage_check import check_shared_folder

    init_distributed(60)
    errors = []
    for folders in cases:
        try:
            check_shared_folder(folders[get_rank()], "trainer.default_local_dir")
            errors.append(None)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def _snapshot(path) -> dict:
    """Every folder under `path` (value None) and every file with its bytes."""
    out = {}
    for d, dirs, names in os.walk(path):
        out.update({os.path.relpath(os.path.join(d, x), path) + "/": None for x in dirs})
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), path)] = f.read()
    return out


@pytest.mark.slow
def test_node_local_folders_are_refused_and_a_shared_folder_passes(tmp_path):
    # Two "nodes", each with its own disk: the same run folder name, different contents.
    node_disks = [str(tmp_path / "node0" / "checkpoints"), str(tmp_path / "node1" / "checkpoints")]
    # One shared folder that already holds a checkpoint: accepted, and left exactly as it was.
    shared = tmp_path / "shared" / "checkpoints"
    (shared / "global_step_3").mkdir(parents=True)
    (shared / "global_step_3" / "COMPLETE.json").write_text('{"files": {}}')
    (shared / "latest_checkpointed_iteration.txt").write_text("3")
    before = _snapshot(shared)

    per_rank = run_distributed(_probe, 2, [node_disks, [str(shared)] * 2], timeout=120)
    (local0, shared0), (local1, shared1) = per_rank
    assert local0 is not None and local0 == local1, per_rank
    assert "must be on a filesystem shared by all nodes" in local0 and "trainer.default_local_dir" in local0, local0
    assert "rank 1 (host" in local0 and "does not see" in local0, local0
    assert os.listdir(node_disks[0]) == [], "the probe folder was left behind"
    assert not os.path.exists(node_disks[1]), "a rank that cannot see the folder must not create it"
    assert shared0 is None and shared1 is None, per_rank
    assert _snapshot(shared) == before


def test_spans_nodes_reads_the_torchrun_layout(monkeypatch):
    import tinyzero.distributed as distributed

    monkeypatch.setattr(distributed, "is_distributed", lambda: False)  # the world size comes from WORLD_SIZE
    for world, local, expected in (("1", "1", False), ("4", "4", False), ("4", "2", True), ("2", "1", True),
                                   ("4", None, True)):
        monkeypatch.setenv("WORLD_SIZE", world)
        if local is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert distributed.spans_nodes() is expected, (world, local)


# ---------------------------------------------------------------------------------------- end to end
def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class Nodes:
    """Two torchrun agents (nodes) of one job, their logs in files."""

    def __init__(self, setup, run: str, attempt: str, env: dict):
        port, root = free_port(), setup.root
        run_dir = root / run
        args = ["--preset", "demo_cpu", f"--data.train_files={root}/data/train.parquet", "--data.val_files",
                f"--actor_rollout_ref.model.path={setup.model}", f"--trainer.default_local_dir={run_dir}",
                f"--reward.custom_fn={root}/reward.py:score", "--reward.timeout_s=0", "--data.train_batch_size=8",
                "--actor_rollout_ref.rollout.n=2", "--actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "--actor_rollout_ref.actor.fsdp_config.fsdp_size=2", f"--trainer.total_training_steps={STEPS}",
                f"--trainer.save_freq={SAVE_FREQ}", f"--reliability.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
                "--trainer.val_before_train=false", "--trainer.plot=false", "--trainer.progress_bar=false",
                "--trainer.export_hf=false"]
        rdzv = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id=tinyzero-{uuid.uuid4().hex[:8]}", "--rdzv_conf=join_timeout=120"]
        self.logs = [root / f"{run}.{attempt}.node{n}.log" for n in range(2)]
        self.procs = []
        for log in self.logs:  # with c10d the agents' join order, not a node rank, numbers the nodes
            with open(log, "w") as f:
                cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, os.path.join(ROOT, "train.py"), *args]
                self.procs.append(subprocess.Popen(cmd, env={**ENV, **env}, cwd=ROOT, stdout=f,
                                                   stderr=subprocess.STDOUT))

    def log(self, node: int) -> str:
        return self.logs[node].read_text()

    def logs_tail(self) -> str:
        return "\n".join(f"---- node {n}:\n{self.log(n)[-5000:]}" for n in range(2))

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill(range(2))
            raise AssertionError(f"the job did not end within {timeout} s\n{self.logs_tail()}") from None

    def kill(self, nodes) -> None:
        """SIGKILL every process of these nodes at once (the agent, its ranks, their scoring workers)."""
        pids = [p for n in nodes if self.procs[n].poll() is None for p in _descendants(self.procs[n].pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for n in nodes:
            self.procs[n].wait(timeout=30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    """Demo data, the test's reward function and the tiny model."""
    from tinyzero.demo import build_data

    root = tmp_path_factory.mktemp("multinode")
    build_data(str(root / "data"))
    (root / "reward.py").write_text(REWARD)
    return SimpleNamespace(root=root, model=tiny_model_dir)


@pytest.fixture
def launch(setup):
    """Nodes(setup, ...) that are all killed at the end of the test, whatever happened."""
    started: list[Nodes] = []

    def start(run: str, attempt: str, env: dict) -> Nodes:
        started.append(Nodes(setup, run, attempt, env))
        return started[-1]

    yield start
    for nodes in started:
        nodes.kill(range(2))


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing", "perf/"))}


@pytest.mark.slow
def test_two_nodes_train_survive_the_loss_of_a_node_and_resume(setup, launch):
    root = setup.root
    ref = launch("ref", "a", {})
    assert ref.wait() == [0, 0], ref.logs_tail()
    expected = read_metrics(str(root / "ref"))
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    assert any(r["actor/pg_loss"] != 0 for r in expected), "the reward must move the policy for the test to mean much"

    sealed = root / "run" / "checkpoints" / f"global_step_{SAVE_FREQ}" / "COMPLETE.json"
    ready = root / "run.fault"
    fault = {"FAULT_AFTER": str(sealed), "FAULT_READY": str(ready)}
    job = launch("run", "a", fault)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ready.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            job.kill(range(2))
            raise AssertionError(f"no node parked after checkpoint {SAVE_FREQ}\n{job.logs_tail()}")
        time.sleep(0.1)
    parked = int(ready.read_text())
    doomed = [n for n in range(2) if parked in _descendants(job.procs[n].pid)]
    assert len(doomed) == 1, "the parked process belongs to neither agent"
    survivor = 1 - doomed[0]
    killed_at = time.monotonic()
    job.kill(doomed)
    try:
        code = job.procs[survivor].wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        job.kill([survivor])
        raise AssertionError(f"the surviving node still runs {EXIT_BOUND_S} s after the other died\n"
                             f"{job.logs_tail()}") from None
    took = time.monotonic() - killed_at
    log = job.log(survivor)
    assert code != 0, log[-5000:]
    # Each surviving rank reports its own failure: gloo sees the dead peers' connections close.
    for rank in (0, 1):
        assert f"[rank {rank}] failed:" in log, log[-5000:]
    assert "Connection closed by peer" in log and "remote worker crashing" in log, log[-5000:]
    print(f"the surviving node exited {took:.1f} s after the kill (bound {EXIT_BOUND_S} s)")
    assert sealed.exists()
    assert [r["step"] for r in read_metrics(str(root / "run"))] == [1, 2]

    # Both nodes again, the same command: resume from checkpoint 2 and finish.
    again = launch("run", "b", {})
    assert again.wait() == [0, 0], again.logs_tail()
    assert "resumed from" in again.log(0) + again.log(1)
    got = read_metrics(str(root / "run"))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # Both jobs ran the start-up check of the checkpoint folder (4 ranks on 2 nodes); it left nothing behind.
    assert sorted(os.listdir(root / "run" / "checkpoints")) == \
        ["global_step_2", "global_step_4", "latest_checkpointed_iteration.txt"]
    for a, b in zip(expected, got):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])), (a["step"], k, a[k], b[k])
