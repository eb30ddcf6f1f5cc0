"""Fleet capture offline: merging bundles of several hosts, the analysis across nodes, Ray's selectors.

The merged Ray bundle (tests/fixtures/bundles/ray_pyabba_two_nodes) was captured by ``kvdiag capture --ray``
on a real 2-node local cluster (tests/fixtures/ray_cluster.py, scenario pyabba): actor pyabba-a on one
node waits in ray.get on pyabba-b on the other, whose method's thread and a second thread hold two
threading.Locks in opposite orders. The live version is tests/integration/test_fleet_ray.py.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvdiag.analyze.overall import analyze, analyze_by_engine
from kvdiag.analyze.process import analyze_process
from kvdiag.bundle.io import load_bundle
from kvdiag.cli.main import main
from kvdiag.errors import BundleError
from kvdiag.model.evidence import Frame
from kvdiag.model.fleet import RayActorRecord
from kvdiag.runs.fleet.pack import pack_dir, unpack_dir
from kvdiag.runs.fleet.refusal import access_refusal, task_failure
from kvdiag.runs.fleet.select import RayNode, RayWorker, node_names, select_targets

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_ray_bundle_names_the_python_abba_and_the_ray_get_across_nodes() -> None:
    bundle, _ = load_bundle(BUNDLES / "ray_pyabba_two_nodes")
    v = analyze(bundle)
    assert v.kind.value == "lock_order_inversion"
    nodes = {n.node for n in bundle.environment.nodes} if bundle.environment else set()
    stuck = [e for e in v.evidence if "Python lock" in e.role]
    assert len(stuck) == 2 and len({e.tid for e in stuck}) == 2 and all(e.node in nodes for e in stuck)
    waiter = next(e for e in v.evidence if "ray.get" in e.role)
    assert waiter.node != stuck[0].node and waiter.key_frames
    assert v.waits is not None and v.waits.edges[0].kind.value == "ray_get"
    assert (v.waits.edges[0].src.node, v.waits.edges[0].dst.node) == (waiter.node, stuck[0].node)
    assert v.waits.root is not None and v.waits.root.pid == stuck[0].pid
    assert "waited on across nodes" in v.summary
    assert all("/" in name and name.split("/pid-")[0] in nodes for name in analyze_by_engine(bundle))


def test_runtime_threads_are_not_signallers_but_a_thread_running_python_is() -> None:
    """B's ~25 Ray runtime threads (grpc pollers, asio loops, an OpenTelemetry timer) never run Python: the
    inversion stands. Give one of them a Python frame (it runs the program's code, in a timed wait) and it
    might still release a lock: no verdict from the lock rule."""
    bundle, _ = load_bundle(BUNDLES / "ray_pyabba_two_nodes")
    stuck = next(p for p in bundle.processes if any(t.name == "stats-reporter" for t in p.threads))
    verdict = analyze_process(stuck)
    assert verdict is not None and verdict.kind.value == "lock_order_inversion"
    timer = next(t for t in stuck.threads if t.name == "ray::IDLE")
    timer.frames.insert(len(timer.frames) - 2, Frame(name="poll_metrics", kind="python", file="/srv/app/poller.py",
                                                      line=12))
    again = analyze_process(stuck)
    assert again is None or again.kind.value != "lock_order_inversion"


def _pod(tmp: Path, name: str, fixture: str) -> Path:
    dest = tmp / name
    shutil.copytree(BUNDLES / fixture, dest / "bundle")
    return dest


def test_merge_folders_keys_processes_by_node_and_names_a_missing_one(tmp_path: Path) -> None:
    a = _pod(tmp_path, "pod-a", "lock_inversion")
    b = _pod(tmp_path, "pod-b", "healthy_idle")
    c = _pod(tmp_path, "pod-c", "lock_inversion")   # the same pid as pod-a's: a pid is unique per node only
    d = tmp_path / "pod-d"
    d.mkdir()
    out = tmp_path / "merged"
    code, stdout, _ = _run("merge", str(a), str(b), str(c), str(d), "--out", str(out), "--json")
    assert code == 10
    data = json.loads(stdout)
    assert data["verdict"]["kind"] == "lock_order_inversion"
    by = data["verdicts_by_engine"]
    assert {k.split("/")[0] for k in by} == {"pod-a", "pod-b", "pod-c"}
    assert [v["kind"] for k, v in by.items() if k.startswith("pod-c/")] == ["lock_order_inversion"]
    assert [v["kind"] for k, v in by.items() if k.startswith("pod-b/")] == ["healthy"]
    assert any(f["kind"] == "node_not_captured" and f["node"] == "pod-d" for f in data["verdict"]["findings"])
    merged, bdir = load_bundle(out)
    assert sorted((p.node, p.pid) for p in merged.processes if p.pid == 325) == [("pod-a", 325), ("pod-c", 325)]
    raw = [t.raw_path for p in merged.processes for t in p.tools if t.raw_path]
    assert raw and all((bdir / r).is_file() and r.startswith("nodes/") for r in raw)
    assert merged.environment is not None
    assert [(n.node, n.outcome) for n in merged.environment.nodes] == [
        ("pod-a", "captured"), ("pod-b", "captured"), ("pod-c", "captured"), ("pod-d", "refused")]
    # the merged folder is a bundle like any other: analyze agrees with what merge stored
    code2, stdout2, _ = _run("analyze", str(out), "--json")
    assert code2 == 10 and json.loads(stdout2)["agrees_with_run"] is True


def test_merge_without_any_bundle_is_bad_usage(tmp_path: Path) -> None:
    code, _, err = _run("merge", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 2 and "no folder holds a readable bundle" in err


def test_capture_ray_without_ray_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` raises ImportError, as on a host without it
    code, _, err = _run("capture", "--ray", "--out", str(tmp_path / "o"))
    assert code == 3
    assert "pip install 'kvdiag[ray]'" in err and "Traceback" not in err


def test_capture_ray_refuses_a_pid_too() -> None:
    code, _, err = _run("capture", "--ray", "127.0.0.1:6379", "--pid", "1")
    assert code == 2 and "--ray captures a cluster" in err


def _actor(actor_id: str, class_name: str, name: str, node_id: str, pid: int | None) -> RayActorRecord:
    """A live actor as discovery lists it: ``node`` is Ray's node id until the merge names the nodes."""
    return RayActorRecord(actor_id=actor_id, class_name=class_name, name=name, node=node_id, pid=pid, state="ALIVE")


def test_selectors() -> None:
    actors = [_actor("a1", "RayWorkerWrapper", "", "n1", 11), _actor("a2", "Caller", "front", "n1", 12),
              _actor("a3", "DPEngineCoreActor", "", "n2", 21), _actor("a4", "Dead", "", "n2", None)]
    workers = [RayWorker("n1", 11, "WORKER"), RayWorker("n1", 12, "WORKER"), RayWorker("n2", 21, "WORKER"),
               RayWorker("n1", 30, "DRIVER"), RayWorker("n1", 99, "DRIVER"), RayWorker("n2", 40, "SPILL_WORKER")]
    me = {("n1", 99)}
    vllm = select_targets(actors, workers, exclude=me)
    assert {(t.node_id, t.pid) for t in vllm.targets} == {("n1", 11), ("n2", 21), ("n1", 30)}
    every = select_targets(actors, workers, select="workers", exclude=me)
    assert {t.pid for t in every.targets} == {11, 12, 21, 30}
    named = select_targets(actors, workers, patterns=["fr*"], exclude=me)
    assert [t.pid for t in named.targets] == [12] and named.targets[0].label == "actor Caller (front)"
    plain = select_targets(actors[1:2], workers, exclude=me)
    assert [t.pid for t in plain.targets] == [12] and plain.notes
    assert node_names([RayNode("aaaaaaaa1", "10.0.0.1"), RayNode("bbbbbbbb2", "10.0.0.2")]) == {
        "aaaaaaaa1": "10.0.0.1", "bbbbbbbb2": "10.0.0.2"}
    assert set(node_names([RayNode("aaaaaaaa1", "127.0.0.1"), RayNode("bbbbbbbb2", "127.0.0.1")]).values()) == {
        "127.0.0.1/aaaaaa", "127.0.0.1/bbbbbb"}


def test_pack_round_trip_and_refuses_escapes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "raw" / "1").mkdir(parents=True)
    (src / "bundle.json").write_text("{}")
    (src / "raw" / "1" / "gdb.txt").write_text("frames")
    dest = tmp_path / "dest"
    unpack_dir(pack_dir(src), dest)
    assert (dest / "raw" / "1" / "gdb.txt").read_text() == "frames"
    import tarfile

    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(BundleError):
        unpack_dir(evil.getvalue(), tmp_path / "d2")
    assert not (tmp_path / "escape.txt").exists()


# One node's bundle as it came back from ``kvdiag capture --ray`` on a node whose Ray runs under a seccomp
# filter refusing ptrace and process_vm_readv (tests/fixtures/no_ptrace.py): pystack and gdb refused, py-spy
# read the Python stacks through /proc/PID/mem.
NO_PTRACE = BUNDLES / "ray_node_no_ptrace"


def test_a_node_whose_ptrace_tools_were_refused_is_named_with_the_cause_and_fix() -> None:
    bundle, _ = load_bundle(NO_PTRACE)
    why = access_refusal(bundle)
    assert why is not None and why.startswith("ptrace refused: the kernel refused gdb and pystack attaching to pid")
    assert "seccomp filter" in why and "only Python stacks were read" in why and "--cap-add=SYS_PTRACE" in why
    unfiltered = bundle.model_copy(deep=True)
    for p in unfiltered.processes:
        assert p.access is not None
        p.access.seccomp = 0
        p.tools = [t for t in p.tools if t.tool != "py-spy"]
    why = access_refusal(unfiltered)
    assert why is not None and "AppArmor" in why and "no stack was read" in why
    traced = bundle.model_copy(deep=True)
    traced.processes[0].tracer_pid = 4242      # EPERM from a process another debugger holds is not a refusal
    assert access_refusal(traced) is None


def test_a_capture_task_that_cannot_import_kvdiag_names_the_module_and_the_nodes_packages() -> None:
    ray_text = ("ray::kvdiag-capture() (pid=7, ip=127.0.0.1)\nRuntimeError: The remote function failed to import on "
                "the worker. This may be because needed library dependencies are not installed in the worker "
                "environment or cannot be found from sys.path ['/opt/ray/_private/workers', "
                "'/opt/venv/lib/python3.11/site-packages']:\n\nTraceback (most recent call last):\n"
                "  File \"pickle.py\", line 1, in loads\nModuleNotFoundError: No module named '{}'\n")
    outcome, why = task_failure("RayTaskError(RuntimeError)", ray_text.format("kvdiag"))
    assert outcome == "refused" and "kvdiag is not importable by the Python Ray runs on that node" in why
    assert "/opt/venv/lib/python3.11/site-packages" in why and "No module named 'kvdiag'" in why
    assert "another version" in task_failure("RayTaskError", ray_text.format("kvdiag.runs.fleet"))[1]
    assert "No module named 'pydantic'" in task_failure("RayTaskError", ray_text.format("pydantic"))[1]
    assert task_failure("NodeDiedError", "")[0] == "died"
    assert task_failure("RayTaskError(OSError)", "boom\nOSError: disk full\n") == (
        "refused", "the capture task failed there: OSError: disk full")
