"""Counts and sizes in messages: one place for plurals and byte units."""

from __future__ import annotations


def plural(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless n is 1: "1 page", "2 pages", "1,024 tokens"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def format_bytes(n: float) -> str:
    """Decimal units: "2.57 GB", "25.95 MB", "1.00 kB", "512 bytes"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return plural(int(n), "byte")
