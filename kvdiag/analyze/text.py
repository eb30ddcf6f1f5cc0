"""Plain-text rendering of a verdict for the terminal (pure: returns a string)."""

from __future__ import annotations

from kvdiag.model import Verdict


def format_verdict(verdict: Verdict, by_engine: dict[str, Verdict] | None = None, max_frames: int = 12) -> str:
    lines = [f"verdict: {verdict.kind.value} (confidence {verdict.confidence.value})", f"  {verdict.summary}"]
    if verdict.confidence_reasons:
        lines.append(f"  confidence {verdict.confidence.value}: " + "; ".join(verdict.confidence_reasons))
    if verdict.signature:
        lines.append(f"  signature: {verdict.signature}")
    if verdict.known is not None:
        lines.append(f"  {verdict.known.line()}"
                     + (f"; workaround: {verdict.known.workaround}" if verdict.known.workaround else ""))
    if verdict.evidence:
        lines.append("  evidence:")
        for item in verdict.evidence:
            lines.append(f"    pid {item.pid} tid {item.tid}: {item.role}")
            lines += [f"        {frame}" for frame in item.frames[:max_frames]]
            if len(item.frames) > max_frames:
                lines.append(f"        ... {len(item.frames) - max_frames} more")
    if verdict.cycle:
        lines.append("  wait-for cycle:")
        lines += [f"    -> {node}" for node in verdict.cycle]
        lines.append("    -> (back to the first)")
    if by_engine and len(by_engine) > 1:
        lines.append("  per engine:")
        lines += [f"    {name}: {v.kind.value}: {v.summary}" for name, v in by_engine.items()]
    if verdict.findings:
        lines.append("  findings:")
        lines += [f"    {f.kind}: {f.message}" for f in verdict.findings]
    return "\n".join(lines)
