"""The startup summary: one table of the worker lifecycle stages (seconds, bytes)."""

from __future__ import annotations


def format_startup_table(reports: list[list[dict]], extra_rows: list[tuple[str, float, str]] = ()) -> str:
    """Rank 0's stages, with the slowest rank's seconds where ranks differ."""
    if not reports:
        return "(no workers)"
    base = reports[0]
    lines = [f"{'stage':<20}{'seconds':>10}{'memory':>14}  note", "-" * 64]
    total = 0.0
    for i, row in enumerate(base):
        seconds = max(r[i]["seconds"] for r in reports if i < len(r))
        total += seconds
        lines.append(f"{row['stage']:<20}{seconds:>10.3f}{_fmt_bytes(row['bytes']):>14}  {row['note']}")
    for name, seconds, note in extra_rows:
        total += seconds
        lines.append(f"{name:<20}{seconds:>10.3f}{'':>14}  {note}")
    lines.append("-" * 64)
    lines.append(f"{'total':<20}{total:>10.3f}   ({len(reports)} worker{'s' if len(reports) > 1 else ''})")
    return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    sign = "+" if n >= 0 else "-"
    n = abs(n)
    if n >= 2**30:
        return f"{sign}{n / 2**30:.2f} GiB"
    return f"{sign}{n / 2**20:.1f} MiB"
