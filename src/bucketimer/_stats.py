"""Stats: what ``TimerThread.stats()`` returns, on either backend."""

from typing import TypedDict


class Stats(TypedDict):
    """What ``TimerThread.stats()`` returns: the core's counters
    (docs/design.rst, rule 10).  At rest, ``scheduled == ran + cancelled +
    dropped`` and ``slots_free + slots_retired == slots``."""

    scheduled: int
    cancelled: int
    postponed: int
    fired: int
    posted: int
    ran: int
    dropped: int
    wakeups: int
    passes: int
    eventfd_writes: int
    drains: int
    sweeps: int
    reaped: int
    heap_size: int
    list_size: int
    dead: int
    slots: int
    slots_free: int
    slots_retired: int
    ports: int
    buckets: int
    early_fires: int
    #: the lateness of the timers counted in ``lateness_hist``, in ns, each
    #: timer's counted at most 2**46 ns (the last bucket's start)
    lateness_sum: int
    #: bucket i counts lateness in [2**(i-1), 2**i) ns; bucket 0, none
    lateness_hist: list[int]
