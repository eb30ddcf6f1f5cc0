"""Verdict accuracy on the hanging-programs corpus, with all tools and with each tool missing in turn.

Every program in tests/fixtures/hangers (hanger_kit.KINDS: GIL cycles in seven shapes, GIL held
while blocked, lock-order inversions with pthread mutexes and Python locks, lost wakeups, blocked
reads on sockets, pipes, multiprocessing queues and asyncio streams, slow starts, a decode stall,
crashes, OOMs, stopped and traced targets, and healthy programs that look stuck in one snapshot)
is started --runs times and captured the way `kvdiag capture --pid` does (all backends,
read-only). Each capture is analyzed as it is, then once per tool as if that tool were missing:
the backends do not feed each other (each reads the target on its own), so dropping one tool's
data from the capture is what a capture without it would have merged
(kvdiag.capture.merge.bundle_without_tool). The expected verdict of each program comes from how it was
written (hanger_kit.KINDS), never from the analyzer.

Metrics per mode: accuracy; false deadlocks = runs of progressing programs (healthy, slow_start)
given a hang verdict; missed deadlocks = runs of hanging programs (a hang kind expected) called
healthy or slow_start.

The next program is started (and waits until it has parked) while the current one is captured; captures
never overlap. ``--no-overlap`` starts each program only after the previous capture.

The cross-process programs (hanger_kit.KINDS[...].xproc: ZMQ REQ/REP, DEALER/ROUTER, PUSH/PULL, a rank
missing at a barrier, Popen.wait on a child blocked on its pipe, a writer on a full pipe, an shm ring,
a chain of three, a socket cycle, a peer outside the tree, and healthy look-alikes) get their own table:
each running program is captured twice in a row, with and without following wait edges out of the
tree (alternating which goes first), both analyzed with all tools; the capture-time ratio is
with/without on the same program instance.

    python benchmarks/accuracy.py [--runs 3] [--xproc-runs 2] [--no-overlap] [--only NAME ...]
                                  [--keep-bundles tests/fixtures/bundles/corpus]

``--corpus blind`` scores the blind corpus instead (tests/fixtures/blind: hanging programs and healthy
look-alikes written from public bug reports by someone who had not read the analyzer). Each program is
started, waited for until it reports readiness, and captured by the real CLI, as a user would:
``kvdiag capture --pid ROOT --out DIR`` (its whole process tree); the verdict is read from report.json.
A case is right when the verdict is one of the kinds the case accepts; false deadlocks = healthy
programs given a hang or failure verdict; missed deadlocks = hanging programs called healthy or
slow_start.

    python benchmarks/accuracy.py --corpus blind [--runs 1] [--only NAME ...] [--keep-wrong DIR]

``--corpus blind3`` does the same for the third blind corpus (tests/fixtures/blind3: families the first
one does not cover), ``--corpus blind4`` for the fourth (tests/fixtures/blind4: families none of
the earlier ones cover), ``--corpus blind5`` for the fifth (tests/fixtures/blind5: again new
families) and ``--corpus blind6`` for the sixth (tests/fixtures/blind6: again new families).
``--cli-cwd DIR`` runs ``python -m kvdiag`` from another checkout, to score that
checkout's analyzer with these programs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "hangers"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "blind"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "blind3"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "blind4"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "blind5"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "blind6"))

import blind3_cases as blind3  # noqa: E402
import blind4_cases as blind4  # noqa: E402
import blind5_cases as blind5  # noqa: E402
import blind6_cases as blind6  # noqa: E402
import blind_cases as blind  # noqa: E402
import hanger_kit as hk  # noqa: E402

from kvdiag.analyze.overall import analyze  # noqa: E402
from kvdiag.bundle.io import save_bundle  # noqa: E402
from kvdiag.capture.bundle import capture_tree  # noqa: E402
from kvdiag.capture.merge import bundle_without_tool  # noqa: E402
from kvdiag.model.bundle import Bundle  # noqa: E402
from kvdiag.model.kinds import VerdictKind  # noqa: E402
from kvdiag.model.verdict import Verdict  # noqa: E402

TOOLS = ("proc", "py-spy", "pystack", "gdb")
MODES = ("all_tools", *(f"no_{t}" for t in TOOLS))
PROGRESSING = frozenset({"healthy", "slow_start"})


def drop(bundle: Bundle, mode: str) -> Bundle:
    if mode == "all_tools":
        return bundle
    return bundle_without_tool(bundle, mode.removeprefix("no_"))


def keep_bundle(bundle: Bundle, dest: Path, kind: str) -> None:
    """bundle.json only (the analyzer reads nothing else), with machine-specific paths made relative."""
    shutil.rmtree(dest, ignore_errors=True)
    copy = bundle.model_copy(deep=True)
    copy.command = f"capture --pid {bundle.processes[0].pid if bundle.processes else 0}  # corpus {kind}"
    copy.host.cpus = None
    copy.environment = None
    for e in copy.engines:
        e.log_path = "service.log" if e.log_path else None
    for p in copy.processes:
        p.log_files = ["service.log" for _ in p.log_files]
        if p.progress is not None:
            p.progress.log_growth = {f"service-{i}.log": n for i, n in enumerate(p.progress.log_growth.values())}
        for r in p.tools:
            r.raw_path = None
    save_bundle(copy, dest)


def _start(kind: str) -> tuple[ExitStack, hk.Hanger]:
    """Start ``kind`` and wait until it has parked; the stack stops it (process group killed)."""
    stack = ExitStack()
    try:
        return stack, stack.enter_context(hk.running(kind, bound_s=90))
    except BaseException:
        stack.close()
        raise


def _submit(starter: ThreadPoolExecutor | None, kind: str) -> Future[tuple[ExitStack, hk.Hanger]]:
    if starter is not None:
        return starter.submit(_start, kind)
    done: Future[tuple[ExitStack, hk.Hanger]] = Future()
    done.set_result(_start(kind))
    return done


class CrossResult:
    """The cross-process table: verdicts with and without following edges, and capture times."""

    def __init__(self) -> None:
        self.tally: dict[str, dict[str, Counter[str]]] = {"follow": {}, "no_follow": {},
                                                          **{f"follow_{m}": {} for m in MODES[1:]}}
        self.chain_ok: dict[str, Counter[bool]] = {}
        self.times: dict[str, list[tuple[float, float]]] = {}   # kind -> [(with, without)]

    def score(self, mode: str) -> dict[str, float]:
        total = correct = progressing = false_dl = hanging = missed = 0
        for kind, seen in self.tally[mode].items():
            expect = hk.KINDS[kind].expect
            for verdict, n in seen.items():
                total += n
                correct += n * (verdict == expect)
                if expect in PROGRESSING:
                    progressing += n
                    false_dl += n * VerdictKind(verdict).is_hang
                else:
                    hanging += n
                    missed += n * (verdict in PROGRESSING)
        return {"accuracy": correct / max(total, 1), "false_deadlock": false_dl, "progressing": progressing,
                "missed_deadlock": missed, "hanging": hanging, "total": total}

    def ratio(self) -> float:
        pairs = [p for ps in self.times.values() for p in ps]
        if not pairs:
            return 0.0
        with_f = sorted(a for a, _ in pairs)[len(pairs) // 2]
        without = sorted(b for _, b in pairs)[len(pairs) // 2]
        return with_f / max(without, 1e-6)

    def result_keys(self) -> str:
        f, n = self.score("follow"), self.score("no_follow")
        if not f["total"]:
            return ""
        return (f"xproc_accuracy={f['accuracy']:.3f} xproc_false_deadlock={f['false_deadlock']:.0f} "
                f"xproc_missed_deadlock={f['missed_deadlock']:.0f} xproc_accuracy_no_follow={n['accuracy']:.3f} "
                f"xproc_false_deadlock_no_follow={n['false_deadlock']:.0f} "
                f"xproc_missed_deadlock_no_follow={n['missed_deadlock']:.0f} follow_capture_ratio={self.ratio():.2f}")


def _chain_ok(kind: str, verdict: Verdict) -> bool:
    """A hang verdict of a cross-process program carries its chain, with the root's frames when it has a root."""
    if not VerdictKind(hk.KINDS[kind].expect).is_hang:
        return verdict.waits is None or not verdict.kind.is_hang
    w = verdict.waits
    return w is not None and bool(w.edges) and (w.cycle or bool(w.root_frames) or w.root_state == "not_captured")


def cross_process(cases: list[str], runs: int, tmp: Path, keep: Path | None) -> CrossResult:
    out = CrossResult()
    for run in range(runs):
        for kind in cases:
            with hk.running(kind, bound_s=90) as h:
                pair: dict[bool, float] = {}
                for follow in ((True, False) if run % 2 == 0 else (False, True)):
                    dest = tmp / f"x-{kind}-{run}-{follow}"
                    t0 = time.monotonic()
                    bundle = capture_tree(h.root_pid, dest, timeout_s=10.0, backends=list(TOOLS), follow=follow)
                    pair[follow] = time.monotonic() - t0
                    verdict = analyze(bundle)
                    mode = "follow" if follow else "no_follow"
                    out.tally[mode].setdefault(kind, Counter())[verdict.kind.value] += 1
                    if follow:
                        out.chain_ok.setdefault(kind, Counter())[_chain_ok(kind, verdict)] += 1
                        for m in MODES[1:]:
                            seen = out.tally[f"follow_{m}"].setdefault(kind, Counter())
                            seen[analyze(drop(bundle, m)).kind.value] += 1
                        if run == 0 and keep is not None:
                            keep_bundle(bundle, keep / kind, kind)
                    shutil.rmtree(dest, ignore_errors=True)
                out.times.setdefault(kind, []).append((pair[True], pair[False]))
    return out


def print_cross(x: CrossResult, skipped: dict[str, str]) -> None:
    if not x.times:
        return
    print("\ncross-process programs (each instance captured with and without following edges out of the tree)")
    if skipped:
        print("skipped: " + "; ".join(f"{k} ({why})" for k, why in skipped.items()))
    width = max(len(k) for k in x.times) + 1
    print(f"{'program':{width}} {'expected':18} {'follow':20} {'no_follow':20} {'chain':6} with/without s")
    for kind, pairs in x.times.items():
        cells = []
        for mode in ("follow", "no_follow"):
            bad = {v: n for v, n in x.tally[mode][kind].items() if v != hk.KINDS[kind].expect}
            cells.append("ok" if not bad else ", ".join(f"{v} x{n}" for v, n in sorted(bad.items())))
        chain = "ok" if not x.chain_ok[kind].get(False) else f"{x.chain_ok[kind][False]} no"
        times = " ".join(f"{a:.2f}/{b:.2f}" for a, b in pairs)
        missing = "; ".join(f"{m.removeprefix('follow_')}: {v} x{n}" for m in x.tally if m.startswith("follow_")
                            for v, n in sorted(x.tally[m][kind].items()) if v != hk.KINDS[kind].expect)
        print(f"{kind:{width}} {hk.KINDS[kind].expect:18} {cells[0]:20} {cells[1]:20} {chain:6} {times}"
              + (f"  [tool missing: {missing}]" if missing else ""))
    for mode in x.tally:
        r = x.score(mode)
        print(f"xproc {mode:18} accuracy {r['accuracy']:.3f}  false deadlocks {r['false_deadlock']:.0f}/"
              f"{r['progressing']:.0f}  missed deadlocks {r['missed_deadlock']:.0f}/{r['hanging']:.0f}")
    print(f"capture with/without following edges: median ratio {x.ratio():.2f}")


FAILED_EXIT = frozenset({4, 10})   # capture's exit codes that claim a hang or a failed engine


def capture_cli(root_pid: int, out: Path, timeout_s: float = 10.0,
                cwd: Path = ROOT) -> tuple[int, dict[str, object]]:
    """`kvdiag capture --pid ROOT --out OUT` as a user runs it; (exit code, report.json's verdict)."""
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "capture", "--pid", str(root_pid), "--out", str(out),
                           "--timeout", str(timeout_s)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout_s + 120)
    report = out / "report.json"
    if not report.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return proc.returncode, {"kind": "error", "summary": f"exit {proc.returncode}: {tail[0]}"}
    verdict = json.loads(report.read_text())["verdict"]
    return proc.returncode, verdict


def _stop_prefetch(pending: Future[tuple[ExitStack, Any]] | None, starter: ThreadPoolExecutor | None,
                   tmp: Path) -> None:
    """Stop the program started ahead for the next round (if any), the starter thread, and remove ``tmp``."""
    if pending is not None:
        try:
            pending.result()[0].close()
        except Exception:   # noqa: BLE001 (a program that failed to start: nothing to stop)
            pass
    if starter is not None:
        starter.shutdown(wait=True)
    shutil.rmtree(tmp, ignore_errors=True)


def _blind_start(name: str, corpus: Any = blind) -> tuple[ExitStack, blind.Target]:
    stack = ExitStack()
    try:
        return stack, stack.enter_context(corpus.running(name, bound_s=90))
    except BaseException:
        stack.close()
        raise


def blind_corpus(args: argparse.Namespace, blind: Any = blind) -> int:
    """Score a blind corpus (``blind_cases``, ``blind3_cases``, ``blind4_cases``, ``blind5_cases`` or
    ``blind6_cases``)
    through the real CLI; prints the table and the RESULT line."""
    names = [n for n in (args.only or blind.CASES) if n in blind.CASES]
    unknown = [n for n in (args.only or []) if n not in blind.CASES]
    if unknown:
        print(f"unknown blind case(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-blind-"))
    order = [(run, n) for run in range(args.runs) for n in names]
    rows: list[tuple[str, int, str, int, str, float]] = []   # name, run, kind, exit, summary, capture s
    start = time.monotonic()
    starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-start") if args.overlap else None
    pending: Future[tuple[ExitStack, blind.Target]] | None = None
    try:
        for i, (run, name) in enumerate(order):
            if pending is None:
                pending = starter.submit(_blind_start, name, blind) if starter else _done(_blind_start(name, blind))
            try:
                stack, target = pending.result()
            except (TimeoutError, OSError) as e:
                pending = None
                rows.append((name, run, "error", -1, f"did not start: {e}", 0.0))
                continue
            pending = None
            with stack:
                if i + 1 < len(order) and starter is not None:
                    pending = starter.submit(_blind_start, order[i + 1][1], blind)
                t0 = time.monotonic()
                rc, verdict = capture_cli(target.root_pid, tmp / f"{name}-{run}", cwd=args.cli_cwd)
                took = time.monotonic() - t0
            kind = str(verdict.get("kind"))
            rows.append((name, run, kind, rc, str(verdict.get("summary", "")), took))
            if args.keep_wrong is not None and not blind.is_right(blind.CASES[name], kind):
                shutil.copytree(tmp / f"{name}-{run}", args.keep_wrong / f"{name}-{run}", dirs_exist_ok=True)
            shutil.rmtree(tmp / f"{name}-{run}", ignore_errors=True)
    finally:
        _stop_prefetch(pending, starter, tmp)

    width = max(len(n) for n in names) + 1
    print(f"{args.corpus} corpus: {len(names)} programs x {args.runs} run(s), captured by `kvdiag capture --pid`"
          f" (kvdiag from {args.cli_cwd})")
    print(f"\n{'case':{width}} {'hangs':5} {'expected (accepted)':44} {'got':22} {'exit':4} {'right':5} {'rule':6} "
          "mentions")
    right = hanging = progressing = missed = false_dl = 0
    wrong: list[str] = []
    for name, _run, kind, rc, summary, _ in rows:
        case = blind.CASES[name]
        ok = blind.is_right(case, kind)
        if case.hangs:
            hanging += 1
            broke = kind in blind.PROGRESSING
            missed += broke
        else:
            progressing += 1
            broke = kind != "error" and (rc in FAILED_EXIT or _claims_hang(kind))
            false_dl += broke
        right += ok
        accepted = "/".join(case.accept)
        mentions = case.mention.lower() in summary.lower()
        print(f"{name:{width}} {'yes' if case.hangs else 'no':5} {accepted[:44]:44} {kind:22} {rc:4} "
              f"{'yes' if ok else 'NO':5} {'BROKEN' if broke else 'ok':6} "
              f"{'yes' if mentions else 'no'} ({case.mention!r})")
        if not ok:
            wrong.append(f"{name}: expected {accepted}, got {kind} (exit {rc}): {summary}")
    total = len(rows)
    captures = sorted(r[5] for r in rows if r[5])
    print(f"\nright {right}/{total}; missed deadlocks {missed}/{hanging} (hang called healthy/slow_start); "
          f"false deadlocks {false_dl}/{progressing} (healthy given a hang or failure)")
    if captures:
        print(f"capture: median {captures[len(captures) // 2]:.1f}s, max {captures[-1]:.1f}s; "
              f"total {time.monotonic() - start:.0f}s")
    if wrong:
        print("\nwrong answers (what kvdiag said):")
        for line in wrong:
            print(f"  {line}")
    print(f"RESULT accuracy={right / max(total, 1):.3f} false_deadlock={false_dl / max(progressing, 1):.3f} "
          f"missed_deadlock={missed / max(hanging, 1):.3f} right={right} total={total} "
          f"missed={missed} hanging={hanging} false={false_dl} progressing={progressing}")
    return 0


def _claims_hang(kind: str) -> bool:
    try:
        return VerdictKind(kind).is_hang
    except ValueError:
        return False


def _done(value: tuple[ExitStack, blind.Target]) -> Future[tuple[ExitStack, blind.Target]]:
    fut: Future[tuple[ExitStack, blind.Target]] = Future()
    fut.set_result(value)
    return fut


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", choices=("hangers", "blind", "blind3", "blind4", "blind5", "blind6"), default="hangers",
                    help="hangers: tests/fixtures/hangers with every tool missing in turn (default); blind: the "
                         "blind corpus (tests/fixtures/blind) through `kvdiag capture --pid`; blind3: the same "
                         "for tests/fixtures/blind3; blind4, blind5, blind6: for tests/fixtures/blind4, blind5, blind6")
    ap.add_argument("--cli-cwd", type=Path, default=ROOT,
                    help="blind corpora: run `python -m kvdiag` from this checkout (default: this one)")
    ap.add_argument("--runs", type=int, default=None, help="runs of each program (default 3; blind: 1)")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="start each program only after the previous one was captured (default: the next one "
                         "boots during the current capture)")
    ap.add_argument("--only", nargs="*", default=None, help="program names (default: all)")
    ap.add_argument("--keep-bundles", type=Path, default=None, help="save the first run's bundles here")
    ap.add_argument("--xproc-runs", type=int, default=2, help="runs of each cross-process program")
    ap.add_argument("--keep-wrong", type=Path, default=None,
                    help="save here the bundle of every capture whose all-tools verdict is wrong")
    args = ap.parse_args()
    if args.corpus in ("blind", "blind3", "blind4", "blind5", "blind6"):
        args.runs = args.runs or 1
        corpora = {"blind": blind, "blind3": blind3, "blind4": blind4, "blind5": blind5,
                   "blind6": blind6}
        return blind_corpus(args, corpora[args.corpus])
    args.runs = args.runs or 3
    tmp = Path(tempfile.mkdtemp(prefix="kvdiag-bench-accuracy-"))
    chosen = [k for k in (args.only or hk.KINDS) if k not in hk.BENCH_EXCLUDE]
    xcases = [k for k in chosen if hk.KINDS[k].xproc and hk.available(k) is None]
    xskipped = {k: why for k in chosen if hk.KINDS[k].xproc and (why := hk.available(k)) is not None}
    xresult = cross_process(xcases, args.xproc_runs, tmp, args.keep_bundles)
    cases = [k for k in chosen if not hk.KINDS[k].xproc]
    if not cases:
        print_cross(xresult, xskipped)
        print(f"RESULT {xresult.result_keys()}")
        return 0
    skipped = {k: why for k in cases if (why := hk.available(k)) is not None}
    cases = [k for k in cases if k not in skipped]
    tally: dict[str, dict[str, Counter[str]]] = {m: {k: Counter() for k in cases} for m in MODES}
    capture_s: list[float] = []
    start = time.monotonic()
    order = [(run, kind) for run in range(args.runs) for kind in cases]
    # The next program boots and parks while the current one is captured (--no-overlap: one at a time).
    # Only its start-up overlaps: captures never run at once, and each reads only its own target's tree.
    starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-start") if args.overlap else None
    pending: Future[tuple[ExitStack, hk.Hanger]] | None = None
    try:
        for i, (run, kind) in enumerate(order):
            if pending is None:
                pending = _submit(starter, kind)
            stack, h = pending.result()
            pending = None
            with stack:
                if i + 1 < len(order) and starter is not None:
                    pending = _submit(starter, order[i + 1][1])
                t0 = time.monotonic()
                bundle = capture_tree(h.root_pid, tmp / f"{kind}-{run}", timeout_s=10.0, backends=list(TOOLS))
                capture_s.append(time.monotonic() - t0)
            for mode in MODES:
                got = analyze(drop(bundle, mode)).kind.value
                tally[mode][kind][got] += 1
                if mode == "all_tools" and got != hk.KINDS[kind].expect and args.keep_wrong is not None:
                    keep_bundle(bundle, args.keep_wrong / f"{kind}-{run}", kind)
            if run == 0 and args.keep_bundles is not None:
                keep_bundle(bundle, args.keep_bundles / kind, kind)
            shutil.rmtree(tmp / f"{kind}-{run}", ignore_errors=True)
    finally:
        _stop_prefetch(pending, starter, tmp)

    results: dict[str, dict[str, float]] = {}
    for mode in MODES:
        total = correct = progressing = false_dl = hanging = missed = 0
        for kind in cases:
            expect = hk.KINDS[kind].expect
            for verdict, n in tally[mode][kind].items():
                total += n
                correct += n * (verdict == expect)
                if expect in PROGRESSING:
                    progressing += n
                    false_dl += n * VerdictKind(verdict).is_hang
                elif VerdictKind(expect).is_hang:
                    hanging += n
                    missed += n * (verdict in PROGRESSING)
        results[mode] = {"accuracy": correct / max(total, 1), "false_deadlock": false_dl,
                         "progressing": progressing, "missed_deadlock": missed, "hanging": hanging}

    print(f"{len(cases)} programs x {args.runs} runs, each capture analyzed in {len(MODES)} modes")
    if skipped:
        print("skipped: " + "; ".join(f"{k} ({why})" for k, why in skipped.items()))
    width = max(len(k) for k in cases) + 1
    print(f"\n{'program':{width}} {'expected':21} " + " ".join(f"{m:22}" for m in MODES))
    for kind in cases:
        cells = []
        for mode in MODES:
            seen = tally[mode][kind]
            bad = {v: n for v, n in seen.items() if v != hk.KINDS[kind].expect}
            cells.append("ok" if not bad else ", ".join(f"{v} x{n}" for v, n in sorted(bad.items())))
        print(f"{kind:{width}} {hk.KINDS[kind].expect:21} " + " ".join(f"{c:22}" for c in cells))

    kinds = sorted({hk.KINDS[k].expect for k in cases} | {v for k in cases for v in tally["all_tools"][k]})
    print("\nconfusion (all tools): rows expected, columns verdict")
    print(f"{'':21} " + " ".join(f"{k[:10]:>10}" for k in kinds))
    for exp in kinds:
        row = Counter[str]()
        for k in cases:
            if hk.KINDS[k].expect == exp:
                row.update(tally["all_tools"][k])
        if row:
            print(f"{exp:21} " + " ".join(f"{row.get(k, 0) or '.':>10}" for k in kinds))

    print()
    for mode, r in results.items():
        print(f"{mode:12} accuracy {r['accuracy']:.3f}  false deadlocks {r['false_deadlock']:.0f}/"
              f"{r['progressing']:.0f}  missed deadlocks {r['missed_deadlock']:.0f}/{r['hanging']:.0f}")
    print(f"capture: median {sorted(capture_s)[len(capture_s) // 2]:.1f}s, max {max(capture_s):.1f}s; "
          f"total {time.monotonic() - start:.0f}s")
    a = results["all_tools"]
    missing = {m: r["accuracy"] for m, r in results.items() if m != "all_tools"}
    worst = min(missing, key=lambda m: missing[m])
    extra = " ".join(f"accuracy_{m}={acc:.3f}" for m, acc in missing.items())
    print_cross(xresult, xskipped)
    print(json.dumps({"worst_tool_missing": worst}))
    print(f"RESULT {xresult.result_keys() + ' ' if xresult.times else ''}"
          f"accuracy={a['accuracy']:.3f} false_deadlock={a['false_deadlock'] / max(a['progressing'], 1):.3f} "
          f"missed_deadlock={a['missed_deadlock'] / max(a['hanging'], 1):.3f} "
          f"accuracy_tool_missing={missing[worst]:.3f} {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
