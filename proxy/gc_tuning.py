"""Garbage-collector settings for a process that serves the proxy.

The settings are process-wide, so only the process's owner applies them (`run_proxy`, the
benchmark), never a test or an application that embeds the proxy.
"""

from __future__ import annotations

import gc

from proxy.config import GcTuning


def tune_gc(settings: GcTuning) -> int:
    """Apply `settings`; returns how many objects were frozen.

    Freezing moves everything alive now (modules, config, the app) to a generation the
    collector never scans, so a full collection walks only what requests created since.
    A higher young threshold stops the transient objects of a few concurrent requests from
    triggering a collection every few requests; cyclic garbage is still collected, later."""
    if settings.young_threshold:
        _, middle, old = gc.get_threshold()
        gc.set_threshold(settings.young_threshold, middle, old)
    if not settings.freeze_after_start:
        return 0
    gc.collect()  # what start-up left as garbage is freed, not frozen
    gc.freeze()
    return gc.get_freeze_count()
