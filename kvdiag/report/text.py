"""Plain-text rendering of a verdict for the terminal (pure: returns a string)."""

from __future__ import annotations

from kvdiag.model import ABComparison, Verdict


def format_verdict(verdict: Verdict, by_engine: dict[str, Verdict] | None = None, max_frames: int = 12,
                   ab: ABComparison | None = None) -> str:
    """The verdict with its evidence; an A/B (``ab``) leads with its comparison, the one outcome of an
    A/B, and shows the stock side's verdict as its evidence."""
    if ab is not None:
        lines = [f"outcome: {ab.headline()}", f"  {verdict.summary}",
                 f"the stock side's verdict: {verdict.kind.value} (confidence {verdict.confidence.value})"]
    else:
        lines = [f"verdict: {verdict.kind.value} (confidence {verdict.confidence.value})", f"  {verdict.summary}"]
    if verdict.confidence_reasons:
        lines.append(f"  confidence {verdict.confidence.value}: " + "; ".join(verdict.confidence_reasons))
    if verdict.signature:
        lines.append(f"  signature: {verdict.signature}")
    if verdict.known is not None:
        lines.append(f"  {verdict.known.line()}"
                     + (f"; workaround: {verdict.known.workaround}" if verdict.known.workaround else ""))
    if verdict.evidence:
        lines.append("  evidence (→ the frames the verdict rests on):" if any(i.key_frames for i in verdict.evidence)
                     else "  evidence:")
        for item in verdict.evidence:
            at = f"node {item.node} " if item.node else ""
            lines.append(f"    {at}pid {item.pid} tid {item.tid}: {item.role}")
            shown = [n for n in range(len(item.frames)) if n < max_frames or item.is_key(n)]
            lines += [f"      {'→ ' if item.is_key(n) else '  '}{item.frames[n]}" for n in shown]
            if len(item.frames) > len(shown):
                lines.append(f"        ... {len(item.frames) - len(shown)} more")
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
