"""The shape of a JSON list (issue 22, item 2): what a compressed list keeps by schema.

A list of records is known by its columns: the identifiers when there are few, the
distinct values of a low-cardinality column (statuses) with their counts, a numeric
column as first / last / min / max and its outliers (in a list of identified records,
min and max with the records holding them instead of first and last). A series of numbers (metric points)
is known by first, last, min, max, its trend and its anomalies. Outliers are robust
(Iglewicz and Hoaglin's modified z-score over the median absolute deviation), so one
spike among ten points is found, which a 3-sigma rule over so few points never can.
One pass per column: linear in the list.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

SHAPE_MIN = 5  # a list shorter than this is shown by its elements, not its shape
FEW_IDS = 30  # a list of at most this many records keeps every identifier
LOW_CARDINALITY = 6  # a column with at most this many distinct values lists them
SHAPE_COLUMNS = 8  # columns described per list
OUTLIERS = 3  # outliers kept per column, the largest deviation first
MODIFIED_Z = 3.5  # |0.6745 (x - median) / MAD| above this is an outlier
TREND_SHARE = 0.2  # a fitted change over the series above this share of its range, and
TREND_NOISE = 2.0  # above this many standard deviations of the residuals, is a trend
RECORD_SHARE = 0.9  # share of dict elements that makes a list a list of records
TIME_VALUE = re.compile(r"^\d{4}-\d\d-\d\d")
TIME_KEYS = frozenset({"t", "ts", "time", "timestamp", "date", "at", "when", "period"})


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def shape(
    values: Sequence[Any],
    is_id: Callable[[str, Any], bool],
    skip: Callable[[str], bool],
    few_ids: int = FEW_IDS,
) -> dict[str, Any] | None:
    """The shape of a list of numbers or of records, None for any other list.

    `is_id(key, value)` says whether a column identifies its records; `skip(key)` leaves
    out transport columns; a list of at most `few_ids` records lists every identifier."""
    if len(values) < SHAPE_MIN:
        return None
    if all(_is_number(v) for v in values):
        return series([float(v) for v in values], [str(i) for i in range(len(values))])
    records = [v for v in values if isinstance(v, dict)]
    if len(records) < RECORD_SHARE * len(values):
        return None
    columns: dict[str, int] = {}
    for record in records:
        for key in record:
            if isinstance(key, str):
                columns[key] = columns.get(key, 0) + 1
    kept = [k for k, n in columns.items() if 2 * n >= len(records)]
    time_key = next((k for k in kept if _is_time_column(k, records)), None)
    id_key = next(
        (k for k in kept if k != time_key and all(is_id(k, r.get(k)) for r in records[:50])), None
    )
    labels = [str(r.get(id_key if id_key else time_key or "", i)) for i, r in enumerate(records)]
    found: dict[str, Any] = {"count": len(records)}
    if id_key is not None and len(records) <= few_ids:
        found[f"{id_key}s"] = [r.get(id_key) for r in records]
    numeric = [k for k in kept if k != time_key and _numeric_column(k, records)]
    for key in kept:
        if len(found) > SHAPE_COLUMNS or key in (id_key, time_key) or skip(key):
            continue
        column = [r.get(key) for r in records]
        if key in numeric:
            numbers: list[float] = []
            point_labels: list[str] = []
            for v, label in zip(column, labels, strict=True):
                if isinstance(v, int | float) and not isinstance(v, bool):
                    numbers.append(float(v))
                    point_labels.append(label)
            if time_key is not None and len(numeric) <= 2:
                found[key] = series(numbers, point_labels)
            else:
                found[key] = _column(numbers, point_labels, by_id=id_key is not None)
        elif all(isinstance(v, str | bool) or v is None for v in column):
            counts = Counter(v for v in column if v is not None)
            if len(counts) <= LOW_CARDINALITY and len(counts) < len(column):
                found[key] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))))
    return found


def outlier_records(values: Sequence[Any], skip: Callable[[str], bool]) -> list[int]:
    """The indexes of the records of a list holding a number far from its column's others
    (far_from_median), the farthest first, or (in a list of at least 2 * SHAPE_MIN) the
    one value of a low-cardinality column seen once where its others repeat (the one pod
    in CrashLoopBackOff), at most OUTLIERS: the shape names the value, the record says
    when and what else held (the day revenue fell, its orders too).
    Empty for a list that is no list of records, or shorter than SHAPE_MIN."""
    if len(values) < SHAPE_MIN or not all(isinstance(v, dict) for v in values):
        return []
    records: list[dict[str, Any]] = list(values)
    ranked: list[tuple[float, int]] = []
    for key in records[0]:
        if not isinstance(key, str) or skip(key):
            continue
        column = [r.get(key) for r in records]
        if all(_is_number(v) for v in column):
            numbers = [float(v) for v in column if v is not None]
            median = statistics.median(numbers)
            spread = max(numbers) - min(numbers) or 1.0
            for index in far_from_median(numbers)[:OUTLIERS]:
                ranked.append((-abs(numbers[index] - median) / spread, index))
        elif len(records) >= 2 * SHAPE_MIN and all(isinstance(v, str) for v in column):
            counts = Counter(column)  # a status held once where the others repeat
            if len(counts) <= LOW_CARDINALITY and max(counts.values()) > 1:
                ranked += [(-1.0, i) for i, v in enumerate(column) if counts[v] == 1]
    found: list[int] = []
    for _, index in sorted(ranked):
        if index not in found:
            found.append(index)
    return found[:OUTLIERS]


def _is_time_column(key: str, records: list[dict[str, Any]]) -> bool:
    sample = [r.get(key) for r in records[:20]]
    if all(isinstance(v, str) and TIME_VALUE.match(v) for v in sample):
        return True
    return key.lower() in TIME_KEYS and all(_is_number(v) for v in sample)


def _numeric_column(key: str, records: list[dict[str, Any]]) -> bool:
    present = [r.get(key) for r in records if r.get(key) is not None]
    return bool(present) and sum(_is_number(v) for v in present) >= RECORD_SHARE * len(present)


def _column(numbers: list[float], labels: list[str], by_id: bool = False) -> dict[str, Any]:
    """first / last / min / max and the outliers. `by_id` (the labels are the records'
    identifiers, no time orders them): min and max each with the record holding it
    (`min_at`, `max_at`, when one record alone holds it) instead of first and last, the
    values of whichever records happen to come first: "the account with the highest MRR"
    names a record by its column's extreme, as an id would, never by its position."""
    low, high = min(numbers), max(numbers)
    described: dict[str, Any] = {}
    if not by_id:
        described.update(first=_plain(numbers[0]), last=_plain(numbers[-1]))
    for name, extreme in (("min", low), ("max", high)):
        described[name] = _plain(extreme)
        holders = [label for x, label in zip(numbers, labels, strict=True) if x == extreme]
        if by_id and len(holders) == 1 and low < high:
            described[f"{name}_at"] = holders[0]
    outliers = _outliers(numbers, labels)
    if outliers:
        described["outliers"] = outliers
    return described


def series(numbers: list[float], labels: list[str]) -> dict[str, Any]:
    """first, last, min, max, the trend (a least-squares fit against the range, both
    without the anomalies: one spike neither makes nor hides a trend) and the anomalies
    (robust outliers, labelled by their position or time)."""
    described = _column(numbers, labels)
    far = set(far_from_median(numbers))
    kept = [(i, y) for i, y in enumerate(numbers) if i not in far] or list(enumerate(numbers))
    ys = [y for _, y in kept]
    low, high = min(ys), max(ys)
    mean_x = statistics.fmean(i for i, _ in kept)
    mean_y = statistics.fmean(ys)
    spread = sum((i - mean_x) ** 2 for i, _ in kept)
    slope = sum((i - mean_x) * (y - mean_y) for i, y in kept) / spread if spread else 0.0
    change = slope * (kept[-1][0] - kept[0][0])
    noise = statistics.pstdev(y - (mean_y + slope * (i - mean_x)) for i, y in kept)
    trending = abs(change) > max(TREND_NOISE * noise, TREND_SHARE * (high - low))
    described["trend"] = "flat" if not trending else "rising" if change > 0 else "falling"
    if "outliers" in described:
        described["anomalies"] = described.pop("outliers")
    return described


def _outliers(numbers: list[float], labels: list[str]) -> list[str]:
    """`label=value` of the values far from the median, the farthest first."""
    return [f"{labels[i]}={_plain(numbers[i])}" for i in far_from_median(numbers)[:OUTLIERS]]


def far_from_median(numbers: list[float]) -> list[int]:
    """The indexes of the values far from the median (modified z-score), the farthest
    first; when most values are equal, the few that differ."""
    median = statistics.median(numbers)
    deviations = [abs(x - median) for x in numbers]
    mad = statistics.median(deviations)
    if mad > 0:
        far = [i for i, d in enumerate(deviations) if 0.6745 * d / mad > MODIFIED_Z]
    else:
        far = [i for i, d in enumerate(deviations) if d > 0]
        if len(far) > max(OUTLIERS, len(numbers) // 20):
            return []
    far.sort(key=lambda i: (-deviations[i], i))
    return far


def _plain(x: float) -> int | float:
    return int(x) if x == int(x) and abs(x) < 2**53 else round(x, 6)
