"""Admission and worker pools from the control plane: per-tenant settings and pool prices.

The decisions themselves are C (native/admission.h, called by the router once
per request); this module states the settings Python hands in and derives a
pool's price from its device profile. The pricing formula is written once, in
native/admission.h; docs/admission.md repeats it with an example body.

    router.set_tenant(7, TenantPolicy(price_per_1k=2000, budget_per_day=50_000, tokens_per_minute=20_000,
                                      max_request_tokens=4096))
    router.set_pool(0, pool_price_per_1k("h100")); router.set_pool(1, pool_price_per_1k("l4"))
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ._dataplane import ffi


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's admission settings (0 switches a limit off)."""
    price_per_1k: int = 0            # micro-USD per 1,000 tokens
    budget_per_day: int = 0          # micro-USD a day -> 422 when a request's estimate exceeds what is left
    tokens_per_minute: int = 0       # request-level per-key limit -> 429
    max_request_tokens: int = 0      # context limit on chunk_count x 128 + max_output_tokens -> 400
    hi_entropy_factor: float = 0.0   # a request with this entropy factor or more (1.0..5.0) is high-entropy
    hi_per_second: float = 0.0       # high-entropy requests per second kept on the primary pool (0: none) ...
    hi_burst: int = 1                # ... in bursts of up to this many; the rest go to the secondary pool
    # (the tenant's `spilled` counts those decisions; the router's `to_secondary` those placed on a
    # secondary pool, which needs a second healthy pool: with one, they stay on it)

    def __post_init__(self):
        for name in ("price_per_1k", "tokens_per_minute", "max_request_tokens", "hi_burst"):
            if not 0 <= getattr(self, name) < 1 << 32:
                raise ValueError(f"{name} must be 0..2^32-1, not {getattr(self, name)}")
        if not 0 <= self.budget_per_day < 1 << 63:
            raise ValueError(f"budget_per_day must be 0..2^63-1 micro-USD, not {self.budget_per_day}")
        if self.hi_entropy_factor and not 1.0 <= self.hi_entropy_factor <= 5.0:
            raise ValueError(f"hi_entropy_factor is on the entropy factor's scale 1.0..5.0 (or 0: off), "
                             f"not {self.hi_entropy_factor}")
        if not 0 <= self.hi_per_second < float("inf"):     # NaN too: it switched the throttle off
            raise ValueError(f"hi_per_second must be a number >= 0, not {self.hi_per_second}")
        if self.hi_per_second and not self.hi_burst:
            # a burst of 0 keeps none on the primary whatever the rate: it sent them all to the secondary
            raise ValueError("hi_burst must be at least 1 with a hi_per_second rate")

    def cdata(self):
        return ffi.new("struct dp_tenant_cfg *", asdict(self))


def pool_price_per_1k(device: str, batch: int = 16, context: int = 1024) -> int:
    """A pool's price in micro-USD per 1,000 tokens: its device's hourly price over the tokens it
    decodes in that time at a reference operating point (batch, context), from the roofline of
    datapath.serving.devices. Per token, a fast expensive device can be the cheaper pool."""
    from .serving.devices import profile
    prof = profile(device)
    usd_per_token = prof.price_per_hour / 3600 * prof.decode_s_per_token(batch, context)
    return max(1, round(usd_per_token * 1000 * 1e6))
