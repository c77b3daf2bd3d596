"""Latency summaries: bcc-style log2 histograms and HdrHistogram percentiles.

    d = Distribution(t_lane - t_xdp)        # integer samples in ns
    d.count, d.min, d.max, d.mean           # exact, from the samples
    d.percentile(99.9)                      # HdrHistogram, 3 significant digits
    d.summary()                             # {"count", ..., "p50", "p95", "p99", "p999", ...}
    print(d.log2("xdp->lane ns"))           # print_log2_hist's layout

Log2 bucket convention (bcc's): bucket 0 counts v = 0, bucket b >= 1 counts
2^(b-1) <= v < 2^b.
"""
from __future__ import annotations

import math

import numpy as np
from hdrh.histogram import HdrHistogram

LOWEST_NS = 1                   # HdrHistogram's lowest discernible value; 0 is recorded as itself
HIGHEST_NS = 3600 * 10**9       # one hour: anything longer is a stall, not a latency
SIGNIFICANT_DIGITS = 3          # percentiles within 0.1% of the true sample value
# bucket b's upper bound is 2^b: 2^0 .. 2^62 cover every non-negative int64
_LOG2_UPPER = np.left_shift(np.int64(1), np.arange(63, dtype=np.int64))
SUMMARY_PERCENTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}


def log2_hist(buckets, unit: str = "ns") -> str:
    """A log2 histogram in the style of bcc's print_log2_hist (bucket b: 2^(b-1) .. 2^b - 1)."""
    last = max((i for i, v in enumerate(buckets) if v), default=-1)
    if last < 0:
        return "     (no samples)"
    first = min(i for i, v in enumerate(buckets) if v)
    top = max(buckets)
    lines = [f"{unit:>20}{'':>21}: count     distribution"]
    for b in range(first, last + 1):
        lo, hi = ((1 << b) >> 1, (1 << b) - 1)
        lines.append(f"{lo:>20} -> {hi:<17}: {buckets[b]:<9} |{'*' * round(40 * buckets[b] / top):<40}|")
    return "\n".join(lines)


def log2_buckets(samples) -> list[int]:
    """Counts per log2 bucket of non-negative integer samples, for log2_hist."""
    values = np.asarray(samples, dtype=np.int64).ravel()
    if values.size == 0:
        return []
    if values.min() < 0:
        raise ValueError("log2 buckets need samples >= 0 (a negative latency means mismatched clocks)")
    return np.bincount(np.searchsorted(_LOG2_UPPER, values, side="right")).tolist()


def percentile(samples_ns, p: float) -> float:
    """One percentile (0..100) of integer ns samples, by HdrHistogram: what every benchmark quotes.
    A sample outside 0 .. 1 hour (mismatched clocks, a stall) is an error here, not a clamped
    value in the figure."""
    d = Distribution(samples_ns)
    d.check_in_range()
    return d.percentile(p)


class Distribution:
    """The distribution of integer samples in ns: exact count/min/max/mean, HdrHistogram percentiles.

    Samples outside 0 .. 1 hour are clamped into that range for the histograms and counted in
    clamped_low / clamped_high, so a clock glitch shows instead of vanishing; count, min, max and
    mean stay the samples' own. Figures check_in_range() first (metrics.percentile does).
    """

    def __init__(self, samples):
        raw = np.asarray(samples, dtype=np.int64).ravel()
        self.clamped_low = int(np.count_nonzero(raw < 0))
        self.clamped_high = int(np.count_nonzero(raw > HIGHEST_NS))
        values = np.clip(raw, 0, HIGHEST_NS)
        self.count = int(raw.size)
        self.min = int(raw.min()) if self.count else math.nan
        self.max = int(raw.max()) if self.count else math.nan
        self.mean = float(raw.mean()) if self.count else math.nan
        self._top = int(values.max()) if self.count else 0   # the largest value the histogram holds
        self.buckets = log2_buckets(values)
        self._hist = HdrHistogram(LOWEST_NS, HIGHEST_NS, SIGNIFICANT_DIGITS)
        # one record per distinct value: samples repeat a lot at ns resolution
        for value, count in zip(*np.unique(values, return_counts=True)):
            self._hist.record_value(int(value), int(count))

    def check_in_range(self):
        """Raise if a sample was clamped: a percentile of clamped values is no measurement."""
        if self.clamped_low or self.clamped_high:
            raise ValueError(f"{self.clamped_low} of {self.count} samples below 0 and {self.clamped_high} above "
                             f"1 hour (mismatched clocks or a stall): no figure from them")

    def percentile(self, p: float) -> float:
        """The value at percentile p (0..100); NaN when there are no samples."""
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be 0..100, not {p}")
        if self.count == 0:
            return math.nan
        if p:
            # the nearest rank, ceil(p n / 100) (Java HdrHistogram's and the textbook's): this hdrh
            # rounds p n / 100 to the nearest instead, one sample low whenever its fraction is under
            # a half (a p99.9 of 759 samples was the 758th, not the largest); asked for the exact
            # percentile of that rank, it takes it (found by review, session 27)
            rank = max(1, math.ceil(p * self.count / 100 - 1e-9))
            p = rank * 100 / self.count
        # HdrHistogram answers with its bucket's highest equivalent value, which can pass
        # the largest sample; the true percentile never does
        return float(min(self._hist.get_value_at_percentile(p), self._top))

    def summary(self) -> dict:
        """count, min, max, mean, p50, p95, p99, p999 (ns) and the clamped counts."""
        return {"count": self.count, "min": self.min, "max": self.max, "mean": self.mean,
                **{key: self.percentile(p) for key, p in SUMMARY_PERCENTILES.items()},
                "clamped_low": self.clamped_low, "clamped_high": self.clamped_high}

    def log2(self, unit: str = "ns") -> str:
        """The samples as a bcc-style log2 histogram."""
        return log2_hist(self.buckets, unit=unit)
